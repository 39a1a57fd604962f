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
