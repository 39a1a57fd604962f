"""A stop as ``%rpc_init`` begins leaves no cluster behind: the cluster becomes current and
booting together, or neither (the soak of seed 20261130, step 13: a stop 0.16 s into an
init left a current cluster "not started" for good, and every later ``%rpc_init`` said
"an nbrpc cluster is already running (booting)")."""

import pytest

import nbrpc
from nbrpc import _process


@pytest.mark.usefixtures("no_cluster")
def test_a_stop_before_the_boot_begins_leaves_no_current_cluster(monkeypatch):
    def pressed() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(_process, "warn_if_the_host_is_shared", pressed)
    with pytest.raises(KeyboardInterrupt):
        nbrpc.Cluster(n=1, progress=False).start()

    def reached() -> None:
        raise RuntimeError("the next start got past the running cluster's check")

    monkeypatch.setattr(_process, "warn_if_the_host_is_shared", reached)
    with pytest.raises(RuntimeError, match="got past"):  # not AlreadyInitializedError
        nbrpc.Cluster(n=1, progress=False).start()
    with pytest.raises(nbrpc.NotInitializedError):
        nbrpc.current()
