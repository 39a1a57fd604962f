"""tools/soak.py's bounds after a shutdown (docs/soak.md), on made-up figures."""

from types import SimpleNamespace

from conftest import load_tool


def _shutdown(t: float, fds_other: int, view_threads: int) -> dict:
    return {
        "kind": "shutdown", "t": t, "step": int(t), "kernel": 1, "kernel_t": t,
        "rss_mb": 400.0, "shm_n": 0, "shm": [], "sockets": 50, "joined": 2,
        "fds_other": fds_other, "view_threads": view_threads, "threads_other": 40,
        "process_roles": {"engine": 2},
    }  # fmt: skip


def test_a_live_view_s_thread_may_hold_one_descriptor_more_and_nothing_else_may():
    """A live view's thread sends widget updates to the notebook, and ipykernel keeps a
    socket (an eventfd) for each thread that does: at most 3 such threads (bounded on
    their own), so one descriptor each is within the bound; any other is not (the soak of
    seed 20261129 broke the bound 34 times on those alone)."""
    bounds = load_tool("soak").Soak._bounds_of
    me = SimpleNamespace(warmup=0)
    first = _shutdown(10, 83, 0)
    assert bounds(me, [first, _shutdown(20, 85, 2)]) == []
    broken = bounds(me, [first, _shutdown(20, 86, 2)])
    assert len(broken) == 1
    assert broken[0].startswith("fds_other 86 after the shutdown at 20 s"), broken
    assert bounds(me, [first, _shutdown(20, 84, 0)]) != []


def test_a_descriptor_more_is_allowed_per_notebook_socket_the_kernel_counts():
    """Where the kernel counts ipykernel's sockets (one per live thread that sent to the
    notebook), each one more than at the level allows one descriptor more, whatever
    thread holds it: the timer service that shows workers' output got its socket after
    the first shutdown's level once (seed 66, step 140: one eventfd more)."""
    bounds = load_tool("soak").Soak._bounds_of
    me = SimpleNamespace(warmup=0)
    first = {**_shutdown(10, 83, 0), "notebook_pipes": 2}
    assert bounds(me, [first, {**_shutdown(20, 84, 0), "notebook_pipes": 3}]) == []
    assert bounds(me, [first, {**_shutdown(20, 84, 0), "notebook_pipes": 2}]) != []
    # the kernel's count, not the views', decides: two views more but no socket more
    assert bounds(me, [first, {**_shutdown(20, 85, 2), "notebook_pipes": 2}]) != []


def test_the_rss_bound_leaves_the_running_cluster_s_shared_memory_aside():
    """The kernel maps the running cluster's arenas (RssShmem: 37 MB at one run's end,
    mid-work, 0 at the release after); the 50 MB bound is on the rest."""
    bounds = load_tool("soak").Soak._bounds_of
    me = SimpleNamespace(warmup=0)
    minute = {"kind": "minute", "t": 60, "kernel_t": 60, "step": 60, "rss_mb": 440.0,
              "rssshmem_mb": 0.0}  # fmt: skip
    end = {**minute, "kind": "end", "t": 180, "kernel_t": 180, "rss_mb": 520.0, "rssshmem_mb": 37.0}
    assert bounds(me, [minute, end]) == []
    broken = bounds(me, [minute, {**end, "rssshmem_mb": 0.0}])
    assert len(broken) == 1
    assert broken[0].startswith("kernel RSS grew 80 MB"), broken


def test_widgets_past_what_stays_live_by_design_break_the_bound():
    """After a shutdown the kernel holds the widgets that stay live by design (the newest
    bars, boot, status view, panel) and no more: each boot's, view's and bar's were held
    for the kernel's life (40 a cycle, docs/soak.md)."""
    soak = load_tool("soak")
    me = SimpleNamespace(warmup=0)
    first = {**_shutdown(10, 83, 0), "widgets": 40}
    at_most = {**_shutdown(20, 83, 0), "widgets": soak.WIDGETS_MAX}
    assert soak.Soak._bounds_of(me, [first, at_most]) == []
    broken = soak.Soak._bounds_of(me, [first, {**at_most, "widgets": soak.WIDGETS_MAX + 1}])
    assert broken == [f"{soak.WIDGETS_MAX + 1} widgets held after the shutdown at 20 s "
                      f"(step 20) (at most {soak.WIDGETS_MAX})"]  # fmt: skip
