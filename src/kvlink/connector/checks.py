"""A D-side load's integrity check: per source rank, the units to hash and the digest slots
its slices land in (built by `kvlink.connector.verifier`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from kvlink.connector.integrity import UnitViews
from kvlink.plan.verify import VerifySpec
from kvlink.transfer.xfer import Transfer

if TYPE_CHECKING:
    from kvlink.connector.digest_table import DigestSlots


@dataclass
class SourceCheck:
    """One source rank's part of a load's check: its units (and their bytes, looked up when
    the check was planned) and the slots its slices land in."""

    src_rank: int
    spec: VerifySpec
    pool: DigestSlots
    slots: list[int]
    views: UnitViews


@dataclass
class LoadCheck:
    """A load's check across its source ranks."""

    sources: list[SourceCheck]
    seeds: npt.NDArray[np.uint64]  # `block_seeds` of the request
    deadline: float
    reread_at: float | None = None
    rereads: int = 0
    hashed_bytes: int = 0
    units: int = 0
    done: bool = False
    reads: list[Transfer] = field(default_factory=list)
