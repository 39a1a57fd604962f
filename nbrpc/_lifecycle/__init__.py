"""A cluster's life, as the kernel runs it: one family of modules.

* :mod:`.cluster` -- ``nbrpc.Cluster``: its states and their one transition table, the
  current cluster;
* :mod:`.api` -- ``nbrpc.init`` / ``current`` / ``shutdown`` / ``restart`` / ``scale`` /
  ``status`` / ``workers`` / ``stacks``, each on the current cluster;
* :mod:`.boot` -- the boot's steps in order, and :class:`~.boot.Joining`, the steps a boot,
  a grow and a restart share (ranks, joins, records, then one sequence after each join:
  lanes, clocks, device maps, side doors; the process group);
* :mod:`.restart` -- a fresh process for a worker, the rest untouched (``%rpc_restart``);
* :mod:`.scale` -- grow and shrink the running cluster, the rest untouched (``%rpc_scale``),
  and :mod:`.scale_checks`, what it refuses before anything changes;
* :mod:`.collective` -- the workers' ``torch.distributed`` process group (``--process-group``),
  started at the boot, rebuilt at a restart, destroyed at the shutdown;
* :mod:`.progress` -- the boot's progress, shown while it runs;
* :mod:`.ranks` -- ``nbrpc.rank()``: ranks as a script has them;
* :mod:`.actions` -- what ``%rpc_shutdown``, ``%rpc_restart``, ``%rpc_scale`` and
  ``%rpc_stacks`` do and say, for the magics and the cluster panel's buttons.
"""
