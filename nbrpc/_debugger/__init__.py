"""The cross-process debugger: pdb for code running on a worker, typed into the cell
that called it, and the clock that call timeouts keep while it is open.

**Worker side.** ``breakpoint()`` and ``pdb.set_trace()`` inside an RPC call open a
:class:`RemotePdb`: Python's own pdb, whose stdin and stdout are the kernel. Each time pdb
wants a command, what it printed and its prompt (``(Pdb worker1)``) travel to the kernel
(:func:`kernel_prompt`, an RPC from the call's own thread) and the line typed there comes
back. ``c`` ends the session and the call returns as usual; ``q`` ends the call with
:class:`~nbrpc.DebuggerQuitError`. Source lines of notebook code are fetched once from the
kernel's ``linecache`` (the worker has no file for a cell), so ``l`` and ``->`` show them.

**Kernel side.** Prompts arrive on torch's RPC threads, but input can only be read on the
main thread: ipykernel ties an input request to the cell being run, and a terminal belongs
to the main thread. The main thread waits for nbrpc calls in short slices
(``calls.Future.wait``); a prompt wakes it and :func:`serve` runs ``input(prompt)``
there. One session at a time: a second worker's breakpoint waits until the first session
continues or quits, and each session opens with a line naming its worker. The stop button
(KeyboardInterrupt in ``input``) quits the open session and the waiting ones, then
interrupts the cell. While a session is open, the clock of nbrpc's call timeouts stands
still (:mod:`.deadlines`).

**No input channel, no hang.** nbval and nbclient (``make demo``) run cells without an
input box, and a script's stdin may not be a terminal: the worker is told so at its first
prompt, prints a warning line and runs on. The same happens when the kernel's main thread
does not wait on an nbrpc call for :data:`GRACE_S` (it sleeps, computes, or blocks in a
plain torch call). ``PYTHONBREAKPOINT=0`` (the worker's or the kernel's) skips silently.

The family: :mod:`.remote_pdb` (the worker side: ``breakpoint()``, ``pdb.set_trace()``,
the post-mortem session), :mod:`.prompts` (the kernel side: prompts served on the main
thread while it waits on a call), :mod:`.deadlines` (call timeouts on a clock that stands
still while a session is open) and :mod:`.postmortem` (``%rpc_debug``).
"""
