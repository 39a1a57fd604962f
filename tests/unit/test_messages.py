"""What nbrpc says in its own words, without a worker: a rank it shows is ``nbrpc.rank()``
(0 for the kernel, 1..N for the workers, kept for a worker's life), torch's id
(``get_worker_info().id``) is labelled as torch's, and a magic is spelled as it is typed
(``%%rpc`` is the cell magic; a line magic has one ``%``)."""

from __future__ import annotations

import pytest

import nbrpc
from nbrpc._lifecycle.restart import Restarted


def test_the_restart_says_the_rank_kept_and_torchs_new_id_and_what_went():
    done = Restarted(["worker2"], {"worker2": (100, 2)}, {"worker2": (200, 7)}, {"worker2": 2})
    done.seconds = 1.25
    text = done.summary()
    assert text.startswith("nbrpc: worker2 restarted (pid 100 -> 200, nbrpc.rank() 2; torch id ")
    assert "torch id 2 -> 7) in 1.2 s" in text, text
    # %%rpc is the cell magic's name as typed; the sentence says what of it is gone
    assert text.endswith("its RRefs and its globals (set by %%rpc cells or nbrpc.push) are gone")
    assert "rank 7" not in text
    assert "%%rpc namespace" not in text


def test_an_integer_destination_is_named_as_torchs_id():
    with pytest.raises(nbrpc.UnknownWorkerError, match="No worker with torch id 42 in this") as e:
        raise nbrpc.UnknownWorkerError(42, ["worker0", "worker1"])
    assert "get_worker_info().id" in str(e.value)
    assert "Name the worker instead" in str(e.value)
    named = nbrpc.UnknownWorkerError("wroker1", ["worker0", "worker1"])
    assert str(named).startswith("No worker named 'wroker1' in this RPC group. Known workers")


def test_an_object_of_a_restarted_process_names_torchs_old_id():
    error = nbrpc.WorkerDiedError("worker2", restarted=5)
    assert "the process this refers to (torch id 5) is gone" in str(error)
    assert "(rank" not in str(error)
