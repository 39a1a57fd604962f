"""A lane's frames (nbrpc/_wire/lanes/frames.py) cut out of what a socket delivers, however it
arrives: several in one read, one split over reads, one larger than a read, a peer that
closes mid-frame, and a header that is not a peer's."""

from __future__ import annotations

import socket
import struct
import threading

import pytest

from nbrpc._wire.lanes.frames import FRAME, MAX_PAYLOAD, Frames, Outbox


def _frame(call: int, kind: int, payload: bytes) -> bytes:
    return FRAME.pack(call, len(payload), kind) + payload


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def test_several_frames_in_one_read_come_out_one_by_one(pair):
    a, b = pair
    a.sendall(_frame(1, 3, b"one") + _frame(2, 4, b"") + _frame(3, 3, b"three"))
    frames = Frames(b)
    got = [frames.next() for _ in range(3)]
    assert [(c, k, bytes(p)) for c, k, p in got] == [(1, 3, b"one"), (2, 4, b""), (3, 3, b"three")]


def test_a_frame_split_over_reads_and_one_larger_than_a_read_come_whole(pair):
    a, b = pair
    big = bytes(range(256)) * 4096  # 1 MiB: more than one read takes
    whole = _frame(7, 3, b"split") + _frame(8, 3, big) + _frame(9, 5, b"after")

    def send_in_pieces() -> None:
        for i in range(0, len(whole), 1000):
            a.sendall(whole[i : i + 1000])

    sender = threading.Thread(target=send_in_pieces)
    sender.start()
    frames = Frames(b)
    first, second, third = frames.next(), frames.next(), frames.next()
    sender.join()
    assert (first[0], bytes(first[2])) == (7, b"split")
    assert (second[0], second[1], bytes(second[2])) == (8, 3, big)
    assert (third[0], third[1], bytes(third[2])) == (9, 5, b"after")


def test_a_peer_that_closes_mid_frame_or_says_too_much_ends_the_frames(pair):
    a, b = pair
    a.sendall(_frame(1, 3, b"whole") + FRAME.pack(2, 100, 3) + b"only part")
    a.close()
    frames = Frames(b)
    assert bytes(frames.next()[2]) == b"whole"
    assert frames.next() is None  # closed before the rest came
    assert frames.next() is None

    c, d = socket.socketpair()
    with c, d:
        c.sendall(FRAME.pack(1, MAX_PAYLOAD + 1, 3))
        assert Frames(d).next() is None  # not a peer's frame: the connection is dropped


def test_an_outbox_sends_every_frame_in_order_and_refuses_after_close():
    a, b = socket.socketpair()
    lost: list[object] = []
    with a, b:
        outbox = Outbox(a, "test-outbox", threading.Lock(), lost.append)
        for i in range(500):
            assert outbox.put(FRAME.pack(i, 1, 3) + bytes([i % 256]))
        frames = Frames(b)
        got = [frames.next() for _ in range(500)]
        assert [(c, bytes(p)) for c, _, p in got] == [(i, bytes([i % 256])) for i in range(500)]
        outbox.close()
        assert not outbox.put(FRAME.pack(1, 0, 3))
    assert lost == []


def test_a_large_frame_whose_read_times_out_midway_goes_on_where_it_stopped(pair):
    """The main thread's lane reads in slices (``SO_RCVTIMEO``): a sender that pauses in
    the middle of a large frame makes a read time out; the bytes read so far are kept,
    and the next read finishes that frame and then the one after it."""
    a, b = pair
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 50_000))
    big = bytes(range(256)) * 1024  # 256 KiB: more than one read takes
    whole = _frame(7, 3, big) + _frame(8, 3, b"after")
    cut = FRAME.size + 100_000
    a.sendall(whole[:cut])
    frames = Frames(b)
    with pytest.raises(BlockingIOError):
        frames.next()  # the sender paused: the slice ends with the frame in part
    with pytest.raises(BlockingIOError):
        frames.next()  # and again, having read nothing more
    a.sendall(whole[cut:])
    call, kind, payload = frames.next()
    assert (call, kind, len(payload)) == (7, 3, len(big))
    assert bytes(payload) == big
    assert [(c, k, bytes(p)) for c, k, p in [frames.next()]] == [(8, 3, b"after")]
