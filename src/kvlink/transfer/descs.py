"""Validation of what the agent accepts: regions, descriptor lists, index arrays, peer metadata."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True)
class PreparedList:
    """A prepared NIXL descriptor list and the descriptors it was built from."""

    native: Any = field(repr=False)
    descs: npt.NDArray[np.uint64]
    remote_name: str  # "" for a local list

    def __len__(self) -> int:
        return int(self.descs.shape[0])


def as_regions(regions: npt.ArrayLike | Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """``Nx2 (addr, nbytes)`` as a list of int pairs; rejects empty or zero-sized regions."""
    array = np.asarray(regions, dtype=np.uint64)
    if array.ndim != 2 or array.shape[1] != 2:
        raise ValueError(f"regions must be Nx2 (addr, nbytes), got shape {array.shape}")
    pairs = [(int(addr), int(nbytes)) for addr, nbytes in array]
    for addr, nbytes in pairs:
        if addr == 0 or nbytes == 0:
            raise ValueError(f"region (addr={addr:#x}, nbytes={nbytes}) is null or empty")
    return pairs


def as_xfer_descs(descs: npt.ArrayLike) -> npt.NDArray[np.uint64]:
    """``Nx3 (addr, len, dev)`` as a C-contiguous uint64 array (a private copy)."""
    array = np.array(descs, dtype=np.uint64, order="C", copy=True)
    if array.ndim != 2 or array.shape[1] != 3 or array.shape[0] == 0:
        raise ValueError(
            f"descriptors must be a non-empty Nx3 (addr, len, dev) array, got {array.shape}"
        )
    if not np.all(array[:, 1] > 0):
        raise ValueError("every descriptor must have a length > 0")
    return array


def as_index_array(indices: npt.ArrayLike, size: int) -> npt.NDArray[np.int64]:
    """1-D int64 indices into a list of ``size`` descriptors; raises on out-of-range ids."""
    array = np.ascontiguousarray(indices, dtype=np.int64)
    if array.ndim != 1:
        raise ValueError(f"index array must be 1-D, got shape {array.shape}")
    if array.size and (int(array.min()) < 0 or int(array.max()) >= size):
        raise IndexError(
            f"descriptor ids must lie in [0, {size}), got [{int(array.min())}, {int(array.max())}]"
        )
    return array


_MD_MAGIC = b"nixlSerDes|Agent"


def peek_agent_name(metadata: bytes) -> str | None:
    """The agent name inside a NIXL metadata blob, or None if the format is not recognised."""
    start = len(_MD_MAGIC) + 8
    if not metadata.startswith(_MD_MAGIC) or len(metadata) < start:
        return None
    (length,) = struct.unpack_from("<Q", metadata, len(_MD_MAGIC))
    if length > 4096 or len(metadata) < start + length:
        return None
    return metadata[start : start + length].decode("utf-8", errors="replace")
