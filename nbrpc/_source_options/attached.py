"""The attached source's options (``--profile`` / ``--cluster-id``): :class:`Attached`.

``cluster_id`` is declared in :mod:`nbrpc._options` as ``part_of="profile.cluster_id"``;
either option alone asks for the source. The source that reads it is
:mod:`nbrpc._engines.attached`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nbrpc._placement import SourceOptions


@dataclass(frozen=True)
class Attached(SourceOptions):
    """The engines of an ipyparallel cluster someone else started: its ``profile`` and
    ``cluster_id`` (either may be None). Without ``-n`` the boot takes as many engines as
    the cluster was started with (``sized_later``)."""

    source = "profile"
    asks_for = "running ipyparallel cluster"
    typed = False  # given as text: the profile's name
    sized_later = True

    profile: str | None = None
    cluster_id: str | None = None

    @classmethod
    def asked(cls, v: dict[str, Any]) -> bool:
        return v["profile"] is not None or v["cluster_id"] is not None

    @classmethod
    def given(cls, value: Any, parts: dict[str, Any]) -> Attached:
        return cls(profile=value, cluster_id=parts.get("cluster_id"))
