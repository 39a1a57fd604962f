"""The magics in a real IPython shell: arguments, errors with their types, the full cycle."""

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

import nbrpc


@pytest.fixture(scope="module")
def shell():
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "nbrpc")
    return ip


def test_status_prints_every_process(shell, cluster, capsys):
    shell.run_line_magic("rpc_status", "")
    out = capsys.readouterr().out
    for record in cluster.workers:
        assert record.name in out
        assert str(record.pid) in out
    assert "ready" in out


@pytest.mark.parametrize(
    ("line", "error", "match"),
    [
        ("--bogus", UsageError, "unrecognized arguments"),
        ("-n two", UsageError, "invalid int value"),
        ("-n 0", nbrpc.ConfigError, "-n must be at least 1"),
        ("--names 'a b,c'", nbrpc.ConfigError, "bad worker name"),
        ("--names a,a", nbrpc.ConfigError, "unique"),
        ("-n 3 --names a,b", nbrpc.ConfigError, "does not match"),
        ("--init-method udp://x:1", nbrpc.ConfigError, "unsupported --init-method"),
        ("--listen 10.254.254.254", nbrpc.ConfigError, "no network interface of this host"),
        ("--device-map worker1=cuda:0", nbrpc.DeviceMapError, "is not LOCAL->REMOTE"),
        ("--device-map worker1=cpu->cuda:0", nbrpc.DeviceMapError, "CPU tensors need no"),
        ("--gpus all", nbrpc.ConfigError, "only 'auto' is supported"),
        ("--process-group mpi", nbrpc.ConfigError, "use gloo"),
        ("--process-group-workers a", nbrpc.ConfigError, "needs --process-group"),
        ("-n 2", nbrpc.AlreadyInitializedError, "already running"),
    ],
)
def test_bad_input_keeps_its_error_type(shell, cluster, line, error, match):
    """The parser's refusals are UsageErrors; nbrpc's are what nbrpc.init raises."""
    with pytest.raises(error, match=match) as info:
        shell.run_line_magic("rpc_init", line)
    if error is not UsageError:
        assert isinstance(info.value, nbrpc.NbrpcError)
        assert isinstance(info.value, ValueError) == (error is not nbrpc.AlreadyInitializedError)
    assert nbrpc.current() is cluster  # the running cluster is untouched


def test_shutdown_rejects_unknown_arguments(shell, cluster):
    with pytest.raises(UsageError, match="unrecognized arguments: now"):
        shell.run_line_magic("rpc_shutdown", "now")


@pytest.mark.parametrize("magic", ["rpc_status", "rpc_panel", "rpc_debug"])
def test_magics_without_arguments_refuse_them(shell, magic):
    """Found by the soak (docs/soak.md): ``%rpc_status --bogus`` showed the table, as if
    nothing was typed after it; a comment is still no argument."""
    with pytest.raises(UsageError, match=rf"%{magic} takes no arguments \(got '--bogus'\)"):
        shell.run_line_magic(magic, "--bogus")
    with pytest.raises(UsageError, match="got 'worker1'"):
        shell.run_line_magic(magic, "worker1  # just this one")


def test_full_cycle_with_custom_names(shell, cluster, capsys):
    shell.run_line_magic("rpc_shutdown", "")
    assert "shut down" in capsys.readouterr().out
    shell.run_line_magic("rpc_status", "")
    assert "no cluster is running" in capsys.readouterr().out
    with pytest.raises(nbrpc.ConfigError, match=r"fixes a process\'s name for its lifetime"):
        shell.run_line_magic("rpc_init", "-n 1 --self master")
    shell.run_line_magic("rpc_init", "--names ps,trainer1 --timeout 20 --threads 4 --quiet")
    try:
        assert nbrpc.workers() == ["worker0", "ps", "trainer1"]
        assert nbrpc.rpc_sync("trainer1", lambda: "trained") == "trained"
        import torch.distributed.rpc as rpc

        assert rpc.get_rpc_timeout() == 20
    finally:
        shell.run_line_magic("rpc_shutdown", "")
