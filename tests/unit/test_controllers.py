"""The controller tier under the engine sources (``nbrpc/_engines/controller.py``): every
controller writes ``spawn``, ``take`` and ``retire`` with the base's signatures, and the
sources built on ``ControllerSource`` write none of what it does for them."""

from __future__ import annotations

import pytest
from conftest import signature_strays

from nbrpc._engines import SOURCES
from nbrpc._engines.controller import Controller, ControllerSource
from nbrpc._engines.local import LocalController
from nbrpc._engines.slurm import SlurmController
from nbrpc._engines.ssh import HostController

TIER = ("spawn", "take", "retire", "release")
CONTROLLERS = (LocalController, HostController, SlurmController)


@pytest.mark.parametrize("controller", CONTROLLERS, ids=lambda c: c.__name__)
def test_every_controller_writes_the_tier_with_its_signatures(controller):
    must_write = {name: name != "release" for name in TIER}  # release has a default
    strays = signature_strays(Controller, controller, must_write)
    assert not strays, "the controller tier (nbrpc/_engines/controller.py): " + "; ".join(strays)


def test_the_controller_sources_leave_launch_take_and_client_to_the_base():
    built = [s for s in SOURCES if issubclass(s, ControllerSource)]
    assert len(built) == 3, built  # local, ssh, Slurm
    for source in built:
        for name in ("launch", "take", "client", "controller_pid"):
            assert getattr(source, name) is getattr(ControllerSource, name), (
                f"{source.__name__}.{name}: ControllerSource does it from the controller tier"
            )
