"""What travels between the processes of a cluster, and how: torch's RPC and nbrpc's lanes.

torch's TensorPipe agent carries what a lane does not: a small call on one host takes a
lane (:mod:`.lanes`, Unix sockets beside TensorPipe; large CPU tensors on it through
shared memory), everything else TensorPipe. These modules decide what goes into a
message and what happens around a call on the callee:

* :mod:`.lanes` -- the route of a call (a lane, or why TensorPipe carries it), the
  lanes' sockets, messages and threads;
* :mod:`.cancelling` and :mod:`.side_door` -- the stop button's reach into a busy
  process (its calls interrupted, later ones refused), and the socket it answers on
  past its RPC threads;
* :mod:`.sent_functions` -- notebook functions a lane sends call after call, pickled once;
* :mod:`.same_user` -- who may connect to a process's sockets, and the one accept loop
  that admits them;

* :mod:`.pickling` -- notebook code by value (cloudpickle inside torch's RPC pickler),
  tensors out-of-band, RRefs with their ledger label; :mod:`.sent_code` (a function's
  code object marshalled once, kept by the receiver) and :mod:`.unsendable` (what cannot
  travel, said);
* :mod:`.callee` -- what runs around the function a peer asked for (counts, hooks,
  routes) and torch's ``_run_function`` hook;
* :mod:`.output` -- what a call prints on a worker, shown in the calling cell (lines
  updated in place shown in place, tqdm bars drawn);
* :mod:`.native_output` -- what C and C++ write to a worker's file descriptors, forwarded;
  torch's lines about connections nbrpc closed, kept out of the cell;
* :mod:`.bars` -- ``tqdm.auto`` / ``tqdm.notebook`` on a worker: a widget bar in the cell;
* :mod:`.namespace` -- a notebook's module-level names on a worker: one namespace per
  process, as a script's module;
* :mod:`.failures` -- a failed call's exception and traceback, rebuilt by the caller, and
  the last failure kept for a post-mortem;
* :mod:`.recording` -- each process's rows of a call timeline (``nbrpc.record()``);
* :mod:`.stacks` -- every thread's stack, read without the GIL (``nbrpc.stacks()``), and
  :mod:`.stack_dumps`, the kernel's side (dumps from several hosts, read into threads);
* :mod:`.shm` and :mod:`.arena` -- large CPU tensors through shared memory between
  processes of one host; :mod:`.shm_setup`, who shares memory with whom, set up once a
  cluster forms.
"""
