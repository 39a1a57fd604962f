"""The workers leave at a shutdown: their calls in flight, the RRefs every process
releases, the process group and torch's group, in that order (``Cluster.shutdown``).

Graceful (the default): the kernel's calls still running finish first, bounded by the
shutdown's timeout (after :data:`SAY_WAITING_AFTER_S` the cell says which, and that the
stop button cancels them); every live process deletes its user RRefs at once, as torch's
static shutdown does; then each worker leaves by torch's own leave. A worker that died is
removed on its behalf. Not graceful (and the stop button during a graceful one): every
call is cancelled and the kernel forgets every worker at once, so that the next
``init`` starts clean under the same names.
"""

from __future__ import annotations

import logging
import time

from nbrpc import _engines, _group, _ledger, _states, _torch
from nbrpc._calls import facade as calls
from nbrpc._departures import forget, release_stale_token
from nbrpc._engines import worker
from nbrpc._gather import census

from .collective import destroy as destroy_process_group
from .running import Cluster

log = logging.getLogger("nbrpc")

DEAD_RELEASE_TIMEOUT_S = 2.0  # RRefs owned by a dead worker are never confirmed: do not wait
# Releasing the kernel's RRefs takes milliseconds when every owner answers; one that died
# in an earlier cluster leaves torch waiting for the whole timeout, so bound it.
RELEASE_TIMEOUT_S = 5.0
NOTHING_HELD_RELEASE_TIMEOUT_S = 0.2

_stale_pending = [0]  # user RRefs unconfirmed after the last release: their owner died

SAY_WAITING_AFTER_S = 1.0  # a graceful shutdown waiting on calls says so after this


def stopped_while_leaving(cluster: Cluster) -> None:
    """The stop button during a graceful shutdown: every call still running is
    cancelled and the workers are dropped from the group at once (a non-graceful
    shutdown's end), so that the next ``init`` starts clean, under the same names."""
    try:  # a second press here must not leave the leave half done either
        cluster.aside.cancel_everything()
    finally:
        leave(cluster, graceful=False, timeout=0)


def leave(cluster: Cluster, graceful: bool, timeout: float) -> None:
    """The workers leave the RPC group (the dead ones are removed on their behalf)."""
    roster = cluster.booted.roster
    workers = roster.workers()
    if graceful:  # a worker that died on another host is known by its heartbeats only
        # after seconds: one that refuses a call now is dead, and must not be waited on
        census.probe(roster.ready())
    dead = cluster.dead_workers()
    if graceful:
        _wait_for_calls_in_flight(cluster, timeout)
    else:  # nobody leaves by themselves: the kernel forgets them all
        calls.cancel_calls_in_flight()
        _ledger.let_go_settled(everything=True)  # (a graceful leave lets go as it releases)
        dead = [r.name for r in workers]
        _states.stopped(dead)
    # once the calls that might use them ended, while their workers are there to hear it
    left = _torch.release_leftover_contexts()
    if left:
        log.info("nbrpc: released %d distributed autograd context(s) never left", left)
    if dead:
        live = roster.ready()
        _states.left(dead, [r.rank for r in workers if r.name in dead])
        try:
            forget(dead, live)
        except Exception as exc:
            log.warning("removing %s from the group: %s", ", ".join(dead), exc)
    if graceful:
        _release_rrefs(cluster, _release_timeout(timeout, bool(dead)))
        pg = cluster.booted.process_group
        if pg:
            destroy_process_group(pg, roster.ready())
        failed = cluster.engines.leave(_live_engine_ids(cluster), graceful, timeout)
        if failed:
            # torch keeps the group's join/leave token when a leave fails: the next
            # %rpc_init's workers would wait 60 s for it (measured), so release it here
            log.warning(
                "nbrpc: %s could not leave the RPC group cleanly (%s); the group was "
                "cleaned up for the next %%rpc_init",
                ", ".join(failed),
                next(iter(failed.values())),
            )
            dead = dead or list(failed)
    if dead:
        release_stale_token()


def _live_engine_ids(cluster: Cluster) -> list[int]:
    """The engines of the workers not known dead (a dead one's engine answers nothing)."""
    engine_of = cluster.booted.roster.engines()
    if cluster.engines.client is None or not engine_of:
        return []
    dead = set(cluster.dead_workers())
    return [eid for name, eid in engine_of.items() if name not in dead]


def _release_rrefs(cluster: Cluster, timeout_s: float) -> None:
    """Every live process deletes its user RRefs at once, the kernel among them, as
    in torch's static shutdown (see ``_group.release_user_rrefs``)."""
    asked = []
    for eid in _live_engine_ids(cluster):
        try:  # an engine ipyparallel lost since (a job cancelled from outside)
            asked.append(cluster.engines.apply(eid, worker.release_rrefs, timeout_s))
        except Exception as exc:
            log.warning("engine %s cannot release its RRefs: %s", eid, exc)
    try:
        _group.release_user_rrefs(timeout_s)
    except Exception as exc:
        log.warning("releasing the kernel's RRefs: %s", exc)
    _stale_pending[0] = _torch.pending_user_rrefs()  # unconfirmed after the wait: for good
    for ar in asked:
        try:
            ar.get(timeout=timeout_s + 5)
        except Exception as exc:
            log.warning("a worker releasing its RRefs: %s", _engines.remote_message(exc))


def _release_timeout(timeout: float, dead: bool) -> float:
    """How long torch may wait for owners to confirm the kernel's RRef deletions: the
    whole bound for an owner that died (measured: 5 s added to every later shutdown),
    so briefly when the kernel holds no RRef of another process and none newly waits
    for its owner's confirmation (a loaded machine's last ``remote()``)."""
    if dead:
        return DEAD_RELEASE_TIMEOUT_S
    if not _ledger.holds_user_rrefs() and _torch.pending_user_rrefs() <= _stale_pending[0]:
        return NOTHING_HELD_RELEASE_TIMEOUT_S
    return min(timeout, RELEASE_TIMEOUT_S)


def _wait_for_calls_in_flight(cluster: Cluster, timeout: float) -> None:
    """Graceful: the kernel's calls still running finish first (bounded by ``timeout``);
    after :data:`SAY_WAITING_AFTER_S`, the cell says which, for how long at most, and
    that the stop button cancels them."""
    started = time.monotonic()
    deadline, said = started + timeout, False
    while time.monotonic() < deadline:
        try:
            if calls.calls_in_flight() == 0:
                return
        except Exception:
            return
        if cluster.dead_workers():  # a dead worker's calls fail by themselves
            return
        if not said and time.monotonic() - started > SAY_WAITING_AFTER_S:
            said = True
            cluster.aside.say_waiting(deadline - time.monotonic())
        time.sleep(0.05)
    log.warning("shutdown: calls still running after %.0f s; leaving anyway", timeout)
