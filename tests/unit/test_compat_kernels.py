"""How the compatibility tier (tools/compat.py) splits a class's tests among kernels."""

from __future__ import annotations

from conftest import load_tool


def test_a_kernel_ends_after_a_test_that_leaves_a_thread_stuck():
    compat = load_tool("compat")
    stuck = "test_backward_unused_send_function"
    assert stuck in compat.LEAVES_A_THREAD_STUCK
    tests = ["test_a", stuck, "test_debug_info", "test_z"]
    assert compat._kernels_tests(tests, None) == ["test_a", stuck]
    assert compat._kernels_tests(tests[2:], None) == ["test_debug_info", "test_z"]
    assert compat._kernels_tests(tests, 1) == ["test_a"]
    assert compat._kernels_tests([stuck, "test_z"], 5) == [stuck]
