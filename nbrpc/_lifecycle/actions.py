"""What ``%rpc_shutdown``, ``%rpc_restart``, ``%rpc_scale`` and ``%rpc_stacks`` do and the
line each says: one piece of code each, for the magics and for the cluster panel's buttons
(:class:`nbrpc.widgets.ClusterPanel`), which must do exactly what the magics do."""

from __future__ import annotations

from nbrpc import _views

from . import api as lifecycle


def shut_down(release: bool = False) -> str:
    """Shut the cluster down gracefully (``release``: the controller and the warm spare
    engines too); what happened, in one line."""
    if lifecycle.running() is None:
        lifecycle.shutdown(release=release)
        return "nbrpc: no cluster is running" + (
            "; released the controller and spare engines" if release else ""
        )
    cluster = lifecycle.current()
    cluster.shutdown(release=release)
    return (
        f"nbrpc: shut down ({', '.join(r.name for r in cluster.booted.roster.workers())} left)"
        + ("; controller and spare engines released" if release else "")
    )


def restart(*names: str) -> str:
    """Replace workers ``names`` with fresh processes (:func:`.cluster.restart`); what
    happened to each."""
    return lifecycle.restart(*names).summary()


def scale(n: int | None = None, **how: object) -> str:
    """Grow or shrink the running cluster (:func:`.cluster.scale`); what happened, then the
    cluster's summary, as ``%rpc_init`` shows it."""
    done = lifecycle.scale(n, **how)  # type: ignore[arg-type]
    return f"{done.summary()}\n{lifecycle.current().summary()}"


def stacks(*names: str, all_threads: bool = False) -> str:
    """The stacks of each process (or of ``names``), as text: the threads that serve a
    call or run the user's code, and how many others there are; ``all_threads``: every
    thread (``%rpc_stacks --all``)."""
    return _views.stacks_text(lifecycle.stacks(*names), all_threads=all_threads)
