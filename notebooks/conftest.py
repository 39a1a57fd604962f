"""Tutorial 09 (workers on other hosts) runs against fake hosts under nbval.

The hosts are network namespaces with their own sshd (tools/fakehosts.py), built once when
the first cell of notebook 09 runs and removed at the end of the session. The notebook
reads them from ``NBRPC_HOSTS`` / ``NBRPC_SSH_ARGS``, which its kernel inherits. Without
root they cannot be built: the notebook is skipped, and the reason is printed.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

_spec = importlib.util.spec_from_file_location(
    "fakehosts", os.path.join(os.path.dirname(__file__), "..", "tools", "fakehosts.py")
)
fakehosts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fakehosts)

MULTI_HOST = "09_multi_host.ipynb"
_up: list = []


def _is_multi_host(item) -> bool:
    return os.path.basename(str(item.fspath)) == MULTI_HOST


def pytest_collection_modifyitems(config, items):
    why = fakehosts.missing()
    if why:
        for item in items:
            if _is_multi_host(item):
                item.add_marker(pytest.mark.skip(reason=f"{MULTI_HOST}: no fake hosts: {why}"))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if _is_multi_host(item) and not _up:  # before nbval starts the notebook's kernel
        hosts = fakehosts.FakeHosts(2).up()
        _up.append(hosts)
        os.environ["NBRPC_HOSTS"] = "fakeh1,fakeh1,fakeh2"
        os.environ["NBRPC_SSH_ARGS"] = f"-F {hosts.ssh_config}"


def pytest_sessionfinish(session):
    while _up:
        _up.pop().down()
