"""The lanes' route: a small call on a Unix socket beside TensorPipe
(:mod:`nbrpc._wire.lanes`, which holds the lanes, their state and which calls they take).

Asked first (registered in :mod:`nbrpc._calls`): the lanes take the call, and its bytes are
made, or they say why not and TensorPipe is asked. What a lane answers besides a value
stays here: a reply the callee kept (it could not take the lane: an RRef, a tensor that
requires grad or is on a device, too large) is fetched through TensorPipe, a call the
callee could not unpickle is sent again through it (:meth:`Reply.through_torch`, which also
remembers a function that answered with a device's tensor); a lost lane or a reply that
does not unpickle here is the route's failure, for the facade to translate. Before a wait
on a lane's reader thread (a future's callback), the lane's reading is handed over
(:meth:`LaneRoute.before_wait`): the reply waited for may come on that very lane.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.rpc import WorkerInfo

from nbrpc._debugger import prompts
from nbrpc._wire import failures, lanes

from . import tensorpipe_route
from .errors import Sent
from .routes import Done, Outcome, Route


class LaneRoute(Route):
    """A lane to the callee (the module's docstring)."""

    name = "lane"

    def take(
        self, dest: WorkerInfo, func: Any, args: tuple, kwargs: dict | None, main: bool
    ) -> Any:
        chosen = lanes.route(dest, func, args, kwargs, main)
        return None if chosen.lane is None else chosen

    def wait(self, taken: Any, dest: WorkerInfo, sent: tuple, call: Sent) -> Outcome:
        lane, payload, _ = taken
        reply = lane.ask(payload, call.limit, prompts.wait_in_slices_on_main_thread)
        if reply is not None and reply.answered:  # the answer, or the callee's error
            value, error = failures.returned(reply.got)
            return value, error, None
        got, resend = _outcome(reply, dest, sent, call)
        return got if resend is None else tensorpipe_route.waited(dest, resend, call)

    def start(self, taken: Any, dest: WorkerInfo, sent: tuple, call: Sent, done: Done) -> None:
        taken.lane.post(taken.payload, lambda reply: settle(reply, dest, sent, call, done))

    def in_flight(self) -> int:
        return lanes.in_flight()

    def before_wait(self) -> None:
        lanes.hand_over_reading()


def settle(reply: Any, dest: WorkerInfo, sent: tuple, call: Sent, done: Done) -> None:
    """``done`` with a lane's ``reply`` to ``sent`` (on the lane's reader thread, or the
    caller's when the lane was lost as the call left). A call fetched or sent again
    through TensorPipe that torch refuses to start (the worker died meanwhile, a device
    map) fails with that error: the reader thread, which has already let go of this call,
    would end on it, and the call's future would wait forever."""
    try:
        got, resend = _outcome(reply, dest, sent, call)
        if resend is None:
            done(got)
        else:  # fetched, or sent again, through TensorPipe (no wait on this thread)
            tensorpipe_route.started(dest, resend, done)
    except Exception as exc:
        done((None, None, exc))


#: no outcome yet: TensorPipe brings it
_THROUGH_TORCH: Outcome = (None, None, None)


def _outcome(reply: Any, dest: WorkerInfo, sent: tuple, call: Sent) -> tuple[Outcome, tuple | None]:
    """A lane's reply (None: the call's time ran out) as ``(outcome, None)``, or as
    ``(nothing, the call TensorPipe carries instead)``: the reply the callee kept, or the
    call again (the callee could not unpickle it)."""
    if reply is None:
        return (None, call.expired(), None), None
    if reply.lost is not None:
        return (None, None, reply.lost), None
    if reply.unreadable is not None:  # as TensorPipe's reply that does not unpickle here
        return (None, None, reply.unreadable), None
    resend = reply.through_torch(dest, sent)
    if resend is not None:
        return _THROUGH_TORCH, resend
    value, error = failures.returned(reply.got)
    return (value, error, None), None
