"""How the compatibility tier (tools/compat.py) splits a class's tests among kernels."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _compat():
    if "compat" not in sys.modules:
        spec = importlib.util.spec_from_file_location("compat", ROOT / "tools" / "compat.py")
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["compat"] = module
        spec.loader.exec_module(module)
    return sys.modules["compat"]


def test_a_kernel_ends_after_a_test_that_leaves_a_thread_stuck():
    compat = _compat()
    stuck = "test_backward_unused_send_function"
    assert stuck in compat.LEAVES_A_THREAD_STUCK
    tests = ["test_a", stuck, "test_debug_info", "test_z"]
    assert compat._kernels_tests(tests, None) == ["test_a", stuck]
    assert compat._kernels_tests(tests[2:], None) == ["test_debug_info", "test_z"]
    assert compat._kernels_tests(tests, 1) == ["test_a"]
    assert compat._kernels_tests([stuck, "test_z"], 5) == [stuck]
