"""The controller tier under the engine sources (``nbrpc/_engines/controller.py``): every
controller writes ``spawn``, ``take`` and ``retire`` with the base's signatures, and the
sources built on ``ControllerSource`` write none of what it does for them."""

from __future__ import annotations

import inspect

import pytest

from nbrpc._engines import SOURCES
from nbrpc._engines.controller import Controller, ControllerSource
from nbrpc._engines.local import LocalController
from nbrpc._engines.slurm import SlurmController
from nbrpc._engines.ssh import HostController

TIER = ("spawn", "take", "retire", "release")
CONTROLLERS = (LocalController, HostController, SlurmController)


@pytest.mark.parametrize("controller", CONTROLLERS, ids=lambda c: c.__name__)
def test_every_controller_writes_the_tier_with_its_signatures(controller):
    for name in TIER:
        want = inspect.signature(getattr(Controller, name))
        got = inspect.signature(getattr(controller, name))
        assert got == want, (
            f"{controller.__name__}.{name}{got} differs from the controller tier's "
            f"{name}{want} (nbrpc/_engines/controller.py): every controller takes the same"
        )
    for name in ("spawn", "take", "retire"):  # no default
        assert getattr(controller, name) is not getattr(Controller, name), (
            f"{controller.__name__} does not write {name}, which every controller must"
        )


def test_the_controller_sources_leave_launch_take_and_client_to_the_base():
    built = [s for s in SOURCES if issubclass(s, ControllerSource)]
    assert len(built) == 3, built  # local, ssh, Slurm
    for source in built:
        for name in ("launch", "take", "client", "controller_pid"):
            assert getattr(source, name) is getattr(ControllerSource, name), (
                f"{source.__name__}.{name}: ControllerSource does it from the controller tier"
            )
