"""torch's lines about a peer's closed connection: dropped once nbrpc found the peer dead
(or made it leave), kept while it has said nothing of that peer."""

from nbrpc._wire import native_output

READING = (
    "[W1130 09:28:50.996134010 tensorpipe_agent.cpp:723] RPC agent for worker0 encountered "
    "error when reading incoming request from {peer}: EOF: end of file (this error "
    "originated at tensorpipe/transport/uv/connection_impl.cc:132)"
)
SENDING = (
    "[W1130 09:28:50.996134010 tensorpipe_agent.cpp:917] RPC agent for worker0 encountered "
    "error when sending outgoing request #57 to {peer}: EPIPE: broken pipe (this error "
    "originated at tensorpipe/transport/uv/connection_impl.cc:157)"
)


def test_a_send_to_a_peer_found_dead_is_dropped_as_a_read_from_it_is():
    peer = "worker_lines_a"
    for form in (READING, SENDING):
        line = form.format(peer=peer)
        assert native_output.awaits_word(line)  # nothing said of that peer yet: held back
        assert not native_output.expected(line)
    native_output.died([peer])
    try:
        for form in (READING, SENDING):
            line = form.format(peer=peer)
            assert not native_output.awaits_word(line)
            assert native_output.expected(line)
    finally:
        native_output.joined([peer])  # (news again, as for a peer that joined anew)


def test_another_send_error_is_kept():
    peer = "worker_lines_b"
    native_output.died([peer])
    try:
        other = SENDING.format(peer=peer).replace("EPIPE: broken pipe", "ENOMEM: out of memory")
        assert not native_output.expected(other)
    finally:
        native_output.joined([peer])
