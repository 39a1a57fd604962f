"""One cluster, torch's spelling, everything a first session touches: the smoke test that
``make test-torch`` runs on each torch release of the supported range (and ``make test`` on
``.venv``'s own), against a single-process twin.

It is written as a user copies it from torch's docs, with only the start-up replaced by
nbrpc's: ``torch.distributed.rpc`` calls and proxies, ``torch.distributed.autograd`` and
``torch.distributed.optim.DistributedOptimizer``, with notebook-defined code.
"""

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from conftest import STAGE_CELL, notebook_code
from torch.distributed.optim import DistributedOptimizer

pytestmark = pytest.mark.usefixtures("cluster")


def test_torchs_spelling_matches_one_process_on_this_torch(capfd):
    cell = notebook_code(STAGE_CELL + "\ndef scaled(x, k):\n    return x * k\n")
    assert rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1)).tolist() == [2.0, 2.0]
    got = rpc.rpc_async("worker2", cell.scaled, args=(torch.arange(3.0), 2)).wait()
    assert got.tolist() == [0.0, 2.0, 4.0]

    stage1 = rpc.remote("worker1", cell.Stage, args=(1, 5, 4))
    stage2 = rpc.remote("worker2", cell.Stage, args=(2, 4, 3))
    assert stage1.owner().name == "worker1"
    assert not stage1.is_owner()
    x = torch.randn(6, 5, dtype=torch.float64)
    with dist_autograd.context() as ctx:
        out = stage2.rpc_sync().forward(stage1.rpc_sync().forward(x))
        loss = out.pow(2).sum()
        dist_autograd.backward(ctx, [loss])
        g1 = rpc.rpc_sync("worker1", cell.grads_of, args=(stage1, ctx))
        g2 = rpc.rpc_sync("worker2", cell.grads_of, args=(stage2, ctx))
        params = stage1.rpc_sync().param_rrefs() + stage2.rpc_sync().param_rrefs()
        DistributedOptimizer(torch.optim.SGD, params, lr=0.1).step(ctx)

    t1, t2 = cell.Stage(1, 5, 4), cell.Stage(2, 4, 3)
    ref_loss = t2(t1(x)).pow(2).sum()
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    for got_grads, twin in ((g1, t1), (g2, t2)):
        for g, p in zip(got_grads, twin.parameters(), strict=True):
            torch.testing.assert_close(g, p.grad, rtol=1e-12, atol=1e-12)
    torch.optim.SGD([*t1.parameters(), *t2.parameters()], lr=0.1).step()
    for stage, twin in ((stage1, t1), (stage2, t2)):
        for w, p in zip(stage.to_here().weights(), twin.parameters(), strict=True):
            torch.testing.assert_close(w, p.detach(), rtol=1e-12, atol=1e-12)
    # torch's notices about its own internals (TorchScript's, on some releases) are noise here
    assert "deprecated" not in capfd.readouterr().err
