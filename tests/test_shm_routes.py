"""Which messages take shared memory when only some peers share this host's /dev/shm.

Across hosts the fast path must reach only the processes that see this process's
``/dev/shm``: a segment name sent to another host would be a tensor it cannot open. The
routing is plain bookkeeping per thread, checked here without processes; tests/test_hosts.py
checks it between real hosts.
"""

from __future__ import annotations

import torch

from nbrpc import _process
from nbrpc._wire import recording, shm


def _route(obj):
    """What the fast-path reducer does with a large tensor inside ``obj``'s message."""
    reduce = shm.make_reducer(lambda t: "tensorpipe")
    with shm.pickling(obj):
        out = reduce(obj if isinstance(obj, torch.Tensor) else torch.zeros(1 << 20))
    if out == "tensorpipe":
        return "tensorpipe"
    where = out[1][0]
    if isinstance(where, str):  # a segment (the arena is removed with the configuration)
        import os

        os.unlink(os.path.join(shm.SHM_DIR, where))
    return "shm"


def test_only_messages_known_to_go_to_a_peer_take_shared_memory():
    prefix = f"nbrpc-test-{__import__('os').getpid()}"
    shm.configure(prefix, 1024, peers=["worker2"])
    try:
        assert shm.restricted()
        assert _route(torch.zeros(1 << 20)) == "tensorpipe"  # destination unknown
        with shm.sending_to("worker2"):
            assert shm.sending() == "call"
            assert _route(torch.zeros(1 << 20)) == "shm"
        with shm.sending_to("worker3"):
            assert _route(torch.zeros(1 << 20)) == "tensorpipe"  # another host
        result = torch.zeros(1 << 20)
        shm.expect_reply(result, "worker2")
        assert _route(result) == "shm"  # the reply to a peer's call
        assert _route(result) == "tensorpipe"  # once: a later message of it is not a reply
        shm.expect_reply(result, "worker3")
        assert _route(result) == "tensorpipe"
    finally:
        shm.configure("", None)
    assert not shm.restricted()


def test_a_call_names_its_caller_and_whether_a_reply_goes_back():
    import pickle

    from nbrpc import _torch

    udf = _torch.PythonUDF(len, ([1, 2],), {})
    sent, _ = recording.outgoing(udf, _process.name(), reply=True, user=False)
    got = pickle.loads(pickle.dumps(sent))
    assert (got.func, got.args, got.kwargs) == (len, ([1, 2],), {})
    call, caller, _parent, _sent, reply, _origin = recording.header_of(got)
    assert reply is True
    assert caller == _process.name()
    assert call == 0  # not recorded
    assert _torch.run_udf(got) == 2
