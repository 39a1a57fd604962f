"""Small calls between processes of one host: Unix-socket lanes beside TensorPipe.

A small Python call through TensorPipe costs about 0.7 ms here, of which the work (pickle
the call, run it, pickle the reply) is about 30 µs and a pipe ping-pong between two
processes 52 µs. A *lane* is a Unix socket between two processes of a local cluster that
carries such calls with nbrpc's own pickler, so a small round trip costs about what the
pipe and the pickling cost. TensorPipe stays the data plane for everything else.

What takes a lane (decided per call by the caller, :func:`~.caller.route`, whose answer says why
when a call takes none; anything else goes through TensorPipe as before, unchanged):

* ``rpc_sync`` / ``rpc_async`` of a Python function or builtin, from a process of a local
  cluster started with lanes on (``--no-fast-calls`` turns them off), with device maps or
  without;
* whose arguments pickle with no RRef (torch must fork it), no tensor that is not a plain
  dense CPU tensor without ``requires_grad``, and tensor storages of
  :data:`nbrpc._wire.pickling.LANE_TENSOR_BYTES` together at most (larger ones take the
  shared-memory arena);
* not made inside a distributed autograd context (torch records the send and receive
  functions of the backward pass on each RPC), not while torch's profiler records (it
  records the RPC), not from a thread that serves a call (a nested call waits holding its
  thread: on torch's pool :mod:`nbrpc._calls.deadlock` watches such waits), and not of a function
  decorated ``@rpc.functions.async_execution`` (torch completes its future).

The callee runs the call in :func:`nbrpc._wire.callee.run_function`, as TensorPipe's
calls are run: the same output forwarding, failures with their traceback, recording,
stack labels and counts. A large CPU tensor takes the lane through shared memory where
the cluster has it (:mod:`.messages`). A reply that cannot take the lane (it holds an
RRef, a CUDA tensor, a large one without shared memory, or does not pickle) is kept by
the callee and fetched by the caller through TensorPipe (:func:`.callee.take`): torch's
own path, with torch's behaviour. On a GPU
cluster a small CUDA tensor that the caller's device map places on the peer travels
*staged* (:mod:`.messages`: copied to host memory as it is pickled, to the mapped device
as it is unpickled; a reply's by the map back); any other CUDA tensor among the arguments
goes through TensorPipe (its device maps place it), and a function whose reply from a
worker held one is sent there through TensorPipe from then on
(:func:`.caller.answered_on_device`). A request the callee
cannot unpickle (a function it cannot import) is sent again through TensorPipe, unrun, so
its error is the one TensorPipe gives.

Two kinds of lane: the main thread's ``rpc_sync`` writes on a lane of its own per peer and
reads the answer there itself (no thread in between on either side: the callee runs the
call on the lane's own thread); every other call shares one lane per peer, whose calls
leave through an outbox thread (:class:`.frames.Outbox`) and whose replies a
reader thread completes, and the callee runs those on a pool of up to
``num_worker_threads`` threads (:mod:`.pool`: calls that wait on each other behave as on
torch's pool). A notebook function that does not change between calls is pickled once
(:mod:`nbrpc._wire.sent_functions`). An idle lane blocks in ``recv``: no CPU.

Who may connect: the sockets live in a directory of mode 0700 made by the kernel, and a
listener admits a peer only if ``SO_PEERCRED`` says it runs as the same user.

The folder: :mod:`.setup` (lanes on and off), :mod:`.caller` (whether a lane takes a
call, the lanes a caller opens), :mod:`.callee` (peers admitted, calls run, replies kept),
:mod:`.state` (what a process's lanes hold, the frame kinds), :mod:`.frames` and
:mod:`.pool`. The lanes are one route among the call facade's
(:mod:`nbrpc._calls.routes`, whose table says which call takes which route): the lanes'
route (:mod:`nbrpc._calls.lane_route`) asks :func:`route` once per call, sends on the lane
it gets, and hands a lane's reading over before a wait (:func:`hand_over_reading`); the
facade knows nothing of a lane. The pickling of a lane's messages is in
:mod:`nbrpc._wire.pickling`.
"""

from .caller import Choice as Choice, Why as Why, route as route
from .lane import (
    MAIN_SLICE_S as MAIN_SLICE_S,
    Lane as Lane,
    Reply as Reply,
    answered_on_device as answered_on_device,
    hand_over_reading as hand_over_reading,
    in_flight as in_flight,
)
from .messages import place_by as place_by
from .setup import (
    close as close,
    directory as directory,
    open_here as open_here,
    pause as pause,
    set_up as set_up,
)
from .state import (
    ON_DEVICE as ON_DEVICE,
    LaneLost as LaneLost,
    socket_path as socket_path,
)
