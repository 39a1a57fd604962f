"""The public API is what ``__all__`` says, and every name in it resolves."""

import subprocess
import sys

import nbrpc


def test_all_names_resolve():
    for name in nbrpc.__all__:
        assert getattr(nbrpc, name) is not None, name


def test_all_matches_public_names():
    public = {
        name
        for name, value in vars(nbrpc).items()
        if not name.startswith("_") and type(value).__name__ != "module"
    }
    public.discard("annotations")  # from __future__
    public -= {"Any", "TYPE_CHECKING"}  # typing imports
    assert public | {"__version__", "autograd", "optim", "widgets"} == set(nbrpc.__all__)
    assert callable(nbrpc.autograd.backward)
    assert callable(nbrpc.optim.DistributedOptimizer)
    assert callable(nbrpc.widgets.OwnershipView)


def test_magics_are_registered_by_load_ext_only():
    code = (
        "from IPython.core.interactiveshell import InteractiveShell\n"
        "shell = InteractiveShell.instance()\n"
        "import nbrpc\n"
        "assert 'rpc_init' not in shell.magics_manager.magics['line']\n"
        "shell.run_line_magic('load_ext', 'nbrpc')\n"
        "line = set(shell.magics_manager.magics['line'])\n"
        "assert {'rpc_init', 'rpc_shutdown', 'rpc_status'} <= line\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
