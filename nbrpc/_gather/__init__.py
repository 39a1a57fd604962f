"""What the kernel gathers from every process of the running cluster at once: one family.

* :mod:`.census` -- is each process there, its figures (``%rpc_status``), its RRefs
  (``nbrpc.ownership()``), any question (``ask_all``);
* :mod:`.timeline` -- ``nbrpc.record()``: the calls each process served, on one clock;
* :mod:`.stacks` -- ``nbrpc.stacks()``: every thread's stack of every process, now.

Each process's own side is in :mod:`nbrpc._wire` (``recording``, ``stacks``); the views
that draw what is gathered in :mod:`nbrpc._views`.
"""
