"""The caller's side of a lane: whether a lane takes a call (:func:`route`).

:func:`route` is asked once per call (by the lanes' route, :mod:`nbrpc._calls.lane_route`)
and answers with a :class:`Choice`: the lane that takes the call and its bytes, or
:class:`Why` none does (then TensorPipe carries it, as before). The lanes themselves, the
connections a caller opens and the replies they bring, are :mod:`.lane`'s. Sending,
waiting and translating are the call facade's and its routes'
(:mod:`nbrpc._calls.routes`); the lanes' state stays in :mod:`.state`.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

from nbrpc import _process, _torch
from nbrpc._wire import recording
from nbrpc._wire.callee import as_python_call, is_user_call, serving
from nbrpc._wire.namespace import is_notebook_function

from . import messages
from .frames import MAX_PAYLOAD
from .lane import Lane, lane_to
from .state import (
    here,
    reading,
)


class Why(enum.Enum):
    """Why a call takes no lane (:func:`route`): TensorPipe carries it."""

    OFF = "lanes are off in this process (not a local cluster, --no-fast-calls, or closed)"
    PAUSED = "lanes are paused in this process (lanes.pause)"
    NO_LANE = "the peer has no lane (it could not listen for one)"
    NESTED = "it is made by a thread that serves a call"
    CALLBACK = "it is made on a lane's reader thread (a future's callback)"
    ASYNC_EXECUTION = "the function is decorated @rpc.functions.async_execution"
    PROFILER = "torch's profiler records (it records the RPC)"
    AUTOGRAD = "it is made inside a distributed autograd context"
    NOT_LANE = (
        "its arguments hold an RRef or a tensor a lane does not carry, do not pickle, or "
        "pickle to more than a lane's frame holds (1 GiB)"
    )
    ON_DEVICE = (
        "its arguments hold a tensor on a device (CUDA) that no device map to the peer "
        "places, or over a lane's size: TensorPipe's device maps place it"
    )
    ANSWERS_ON_DEVICE = (
        "the function's reply from this worker held a tensor on a device (CUDA) that a "
        "lane did not carry before: TensorPipe brings it, device maps applied, with no "
        "lane round first"
    )
    BUSY = "the main thread's lane to the peer waits on another call"
    ASYNC_ON_GPU = (
        "an rpc_async to a peer this process maps CUDA devices to: TensorPipe runs each "
        "call on CUDA streams of its own and sends the reply when they finish, so calls "
        "run side by side on the GPU and no thread waits for a stream (a lane runs its "
        "calls one after another, each reply's copy waiting for the GPU)"
    )


class Choice(NamedTuple):
    """:func:`route`'s answer: ``lane`` takes the call with ``payload``, or ``why`` says
    why none does. A main-thread lane comes reserved for this call (:meth:`Lane.ask`
    gives it back)."""

    lane: Lane | None
    payload: bytes = b""
    why: Why | None = None


#: a choice of no lane, made once per reason
_NONE = {why: Choice(None, why=why) for why in Why}


def route(dest: Any, func: Any, args: tuple, kwargs: dict | None, main: bool) -> Choice:
    """Whether a lane takes a call of ``func`` to worker ``dest`` (a WorkerInfo) from
    this thread (``main``: the main thread's ``rpc_sync``, which reads its own answer): a
    lane and the call pickled for it, or why TensorPipe carries it (the package's
    docstring; the whole choice of a call's route: :mod:`nbrpc._calls.routes`)."""
    why = why_not(dest, func)
    if why is not None:
        return why
    if not main and messages.places_to(dest.name)[0] is not None:
        return _NONE[Why.ASYNC_ON_GPU]  # (issue 63's risk 5: four 50 ms GPU calls 0.21 s
        # at once on a lane, 0.06 s through TensorPipe, on an H200)
    notebook = is_notebook_function(func)
    if not notebook:  # (a notebook's function is never a builtin)
        func, args, kwargs = as_python_call(func, args, kwargs)
    try:
        user = notebook or is_user_call(func)
        payload = call_bytes(func, args, kwargs or {}, user, dest.name, stage=main)
    except messages.OnDevice:
        messages.unsent()
        return _NONE[Why.ON_DEVICE]
    except Exception:  # NotLane, or what TensorPipe's pickling will report in its words
        messages.unsent()
        return _NONE[Why.NOT_LANE]
    lane: Lane | None = None
    refused: Why | None = None
    if len(payload) > MAX_PAYLOAD:  # (a frame's limit: a peer reading it would drop it)
        refused = Why.NOT_LANE
    else:
        lane = lane_to(dest, main)
        refused = Why.NO_LANE if lane is None else Why.BUSY if main and lane.busy else None
    if lane is None or refused is not None:  # what shared memory its tensors took goes back
        messages.unsent()
        return _NONE[refused or Why.NO_LANE]
    if main:
        lane.busy = True
    return Choice(lane, payload)


def why_not(dest: Any, func: Any) -> Choice | None:
    """A choice of no lane, for what rules a lane out before the call is pickled."""
    if here.directory is None:
        return _NONE[Why.OFF]
    if here.paused:
        return _NONE[Why.PAUSED]
    if dest.id in here.laneless:
        return _NONE[Why.NO_LANE]
    if serving():
        return _NONE[Why.NESTED]
    if reading.lane is not None:
        return _NONE[Why.CALLBACK]
    if getattr(func, "_wrapped_async_rpc_function", None) is not None:
        return _NONE[Why.ASYNC_EXECUTION]
    if _torch.profiler_enabled():
        return _NONE[Why.PROFILER]
    if _torch.in_autograd_context():
        return _NONE[Why.AUTOGRAD]
    if here.on_device and (dest.id, id(func)) in here.on_device:
        return _NONE[Why.ANSWERS_ON_DEVICE]
    return None


def call_bytes(
    func: Any,
    args: tuple,
    kwargs: dict,
    user: bool | None = None,
    peer: str = "",
    stage: bool = True,
) -> bytes:
    """A call pickled for a lane: ``(func, args, kwargs, header, back)``, the header
    (:mod:`nbrpc._wire.recording`) beside the call, not wrapped around torch's call record
    (``user``: whether it is a user's call, :func:`is_user_call` if not said); ``peer``:
    the callee, whose device map places small CUDA tensors, staged where ``stage`` (the
    main thread's ``rpc_sync``: :func:`.messages.lane_call`)."""
    if user is None:
        user = is_user_call(func)
    header, message = recording.header_for(_process.name(), False, True) if user else (None, None)
    payload = messages.lane_call(func, args, kwargs, header, peer, stage)
    if message is not None:
        recording.pickled(message, len(payload))
    return payload
