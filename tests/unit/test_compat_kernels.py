"""How the compatibility tier (tools/compat.py) splits its tests among kernels."""

from __future__ import annotations

from conftest import load_tool


def test_a_kernel_ends_after_a_test_that_leaves_a_thread_stuck():
    compat = load_tool("compat")
    stuck = "test_backward_unused_send_function"
    assert stuck in compat.LEAVES_A_THREAD_STUCK
    tests = [("DistAutogradTest", 4, name) for name in ("test_a", stuck, "test_debug", "test_z")]
    assert compat._kernels_tests(tests, None) == tests[:2]
    assert compat._kernels_tests(tests[2:], None) == tests[2:]
    assert compat._kernels_tests(tests, 1) == tests[:1]
    assert compat._kernels_tests([tests[1], tests[3]], 5) == [tests[1]]


def test_classes_of_one_environment_share_kernels():
    compat = load_tool("compat")
    names = ["RpcTest", "DistAutogradTest", "DdpUnderDistAutogradTest", "RemoteModuleTest"]
    assert set(compat.CLASS_ENV) == {"DdpUnderDistAutogradTest"}  # else: this test's groups
    groups = compat._kernel_groups([compat.Selection(name, 4) for name in names])
    assert [[sel.cls for sel in group] for group in groups] == [
        ["RpcTest", "DistAutogradTest"],
        ["DdpUnderDistAutogradTest"],
        ["RemoteModuleTest"],
    ]


def test_the_second_look_judges_a_later_cluster_s_failures_in_a_first_cluster(monkeypatch):
    """make compat's end: what failed in a kernel's later cluster runs again alone in a
    fresh kernel; passing there it counts as first cluster only, failing there too it
    stays a failure, and the report says which is which."""
    compat = load_tool("compat")
    R = compat.TestResult
    results = [
        R("RpcTest", "test_ok", "passed"),
        R("RpcTest", "test_ids", "failed", "UnknownWorkerError: No worker with torch id 2"),
        R("RpcTest", "test_own", "failed", "AssertionError: 1 != 2"),
        R("RpcTest", "test_hang", "hung", "the kernel stopped answering (killed)"),
    ]
    asked = []

    def fresh_kernels(sels, timeout, log_dir, echo, per_kernel=None):
        asked.append(([(s.cls, list(s.run)) for s in sels], per_kernel))
        return {
            ("RpcTest", "test_ids"): R("RpcTest", "test_ids", "passed"),
            ("RpcTest", "test_own"): R("RpcTest", "test_own", "failed", "AssertionError: 3"),
        }

    monkeypatch.setattr(compat, "run_kernels", fresh_kernels)
    monkeypatch.setattr(
        compat,
        "select",
        lambda tests: [compat.Selection("RpcTest", 4, run=[t.partition(".")[2] for t in tests])],
    )
    looked = compat.second_look(results, 10.0, "/nonexistent", echo=lambda s: None)
    assert asked == [([("RpcTest", ["test_ids", "test_own"])], 1)]  # one test per kernel
    by_name = {r.test: r for r in looked}
    assert [r.test for r in looked] == ["test_ok", "test_ids", "test_own", "test_hang"]
    assert by_name["test_ok"].outcome == "passed"
    assert not by_name["test_ok"].after_reinit
    assert by_name["test_ids"].outcome == "passed"
    assert "No worker with torch id 2" in by_name["test_ids"].after_reinit
    assert by_name["test_own"].outcome == "failed"
    assert by_name["test_own"].error == "AssertionError: 3"  # what its first cluster said
    assert by_name["test_hang"].outcome == "hung"  # hangs are not looked at again
    c = compat.counts(looked)
    assert (c["passed"], c["first cluster only"], c["failed"], c["hung"]) == (2, 1, 1, 1)

    report = compat.markdown(looked, [compat.Selection("RpcTest", 4)], 60.0)
    assert "| RpcTest | 4 | 4 | 4 | 2 | 1 | 1 | 1 | 0 | 0 |" in report
    assert "## Passed in a kernel's first cluster only (1)" in report
    assert "`RpcTest.test_ids`: UnknownWorkerError: No worker with torch id 2" in report
    assert "`RpcTest.test_own`: AssertionError: 3 (failed alone in a fresh kernel's" in report
