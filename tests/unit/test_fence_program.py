"""The member filter's program: how many members one filter holds, and the error past it."""

from __future__ import annotations

import pytest

import nbrpc
from nbrpc import _fence


def test_the_filter_holds_28_ipv4_or_32_ipv6_members_and_refuses_more_with_the_fix():
    assert _fence.program([f"198.51.100.{i}" for i in range(1, 29)])
    assert _fence.program([f"2001:db8::{i:x}" for i in range(1, 33)])
    with pytest.raises(nbrpc.ConfigError, match=r"29 member addresses .* fewer hosts"):
        _fence.program([f"198.51.100.{i}" for i in range(1, 30)])
