"""The calls a notebook makes: :mod:`.facade` (``rpc_sync``, ``rpc_async``, ``remote``: the
facade over torch's, on a lane or through TensorPipe), :mod:`.rrefs` (torch's RRef methods
with nbrpc's errors), :mod:`.spelling` (torch's own names routed to nbrpc's),
:mod:`.deadlock` (nested calls that use up the RPC threads, noticed and ended)."""
