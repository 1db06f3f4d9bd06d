"""NixlAgent: one worker's NIXL agent — memory, peers, prepared lists, transfers, notifications."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from kvlink.transfer import nixl_import
from kvlink.transfer.agent_config import AgentConfig, create_raw_agent
from kvlink.transfer.descs import (
    PreparedList,
    as_index_array,
    as_regions,
    as_xfer_descs,
    peek_agent_name,
)
from kvlink.transfer.xfer import Op, Transfer, TransferFailed, TransferTelemetry, describe

logger = logging.getLogger(__name__)

MemType = Literal["DRAM", "VRAM"]
"""NIXL memory kind of registered regions and prepared lists: host memory or GPU memory."""
MEM_TYPES: tuple[MemType, ...] = ("DRAM", "VRAM")


def check_mem_type(mem_type: str) -> MemType:
    """``mem_type`` if NIXL knows it as a memory kind kvlink uses, else ``ValueError``."""
    if mem_type not in MEM_TYPES:
        raise ValueError(f"mem_type must be one of {', '.join(MEM_TYPES)}, got {mem_type!r}")
    return mem_type  # type: ignore[return-value]


class NixlAgent:
    """Wraps one ``nixl_agent``; not thread-safe, so one thread should own it.

    Prepared descriptor lists are named by small integer handles. Every NIXL
    error on a transfer path surfaces as ``TransferFailed``.

    ``mem_type`` is the memory kind of this agent's KV, chosen once: ``"DRAM"`` (host
    memory, the default) or ``"VRAM"`` (GPU memory; descriptors then carry the CUDA device
    id in their third column, as the layout's ``device_id`` does). Regions and lists take
    it unless a call names another kind, e.g. a host-memory table next to a GPU KV cache.
    A remote list takes the same kind: the peer's memory is assumed to be of this agent's kind.
    """

    def __init__(self, name: str, config: AgentConfig | None = None, *,
                 mem_type: MemType = "DRAM") -> None:
        self.config = config or AgentConfig()
        self.name = name
        self.mem_type: MemType = check_mem_type(mem_type)
        self._agent: Any = create_raw_agent(name, self.config)
        self._registered: dict[tuple[int, int], Any] = {}
        self._remotes: dict[str, bytes] = {}
        self._dlists: dict[int, PreparedList] = {}
        self._next_dlist = 1
        self._unreleased: list[Transfer] = []
        self._pending_notifs: dict[str, list[bytes]] = {}

    def register_regions(self, regions: npt.ArrayLike | Sequence[tuple[int, int]], *,
                         mem_type: MemType | None = None, device_id: int = 0) -> int:
        """Register regions given as (addr, nbytes) as ``mem_type`` (default: the agent's) on
        ``device_id`` (the CUDA device for VRAM; 0 for DRAM); returns how many were new."""
        kind = self._kind(mem_type)
        if device_id < 0:
            raise ValueError(f"device_id must be >= 0, got {device_id}")
        # Aliased layers (one memory, several layers) give the same region more than once.
        fresh = [r for r in dict.fromkeys(as_regions(regions)) if r not in self._registered]
        for addr, nbytes in fresh:
            descs = np.array([[addr, nbytes, device_id]], dtype=np.uint64)
            self._registered[(addr, nbytes)] = self._agent.register_memory(descs, kind)
        return len(fresh)

    def _kind(self, mem_type: MemType | None) -> MemType:
        return self.mem_type if mem_type is None else check_mem_type(mem_type)

    def deregister_all(self) -> None:
        for reg_descs in self._registered.values():
            self._agent.deregister_memory(reg_descs)
        self._registered.clear()

    def metadata(self) -> bytes:
        """This agent's metadata; re-send it to peers after registering more memory."""
        return bytes(self._agent.get_agent_metadata())

    def add_remote(self, metadata: bytes) -> str:
        """Load a peer's metadata and return its agent name.

        A restarted peer keeps its name but sends a new blob; the old one is
        removed first (NIXL refuses to overwrite it).
        """
        name = peek_agent_name(metadata)
        if name is not None and self._remotes.get(name, metadata) != metadata:
            logger.info("agent %s: peer %s sent new metadata, replacing it", self.name, name)
            self.remove_remote(name)
        try:
            loaded = self._agent.add_remote_agent(metadata)
        except nixl_import.NixlNotAllowedError as exc:
            raise ValueError(
                f"agent {self.name}: a different metadata blob is already loaded for this peer "
                f"({describe(exc)}); call remove_remote(name) first"
            ) from exc
        loaded_name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        self._remotes[loaded_name] = metadata
        return loaded_name

    def remove_remote(self, name: str) -> None:
        """Forget a peer and release the remote lists prepared for it (unknown names are ignored)."""
        for handle in [h for h, d in self._dlists.items() if d.remote_name == name]:
            self.release_dlist(handle)
        self._agent.remove_remote_agent(name)
        self._remotes.pop(name, None)

    @property
    def remote_names(self) -> frozenset[str]:
        return frozenset(self._remotes)

    def prep_local(self, descs: npt.ArrayLike, *, mem_type: MemType | None = None) -> int:
        """Prepare local descriptors ``Nx3 (addr, len, dev)`` of ``mem_type`` (default: the
        agent's); returns a handle."""
        return self._prep("", as_xfer_descs(descs), self._kind(mem_type))

    def prep_remote(self, remote_name: str, descs: npt.ArrayLike, *,
                    mem_type: MemType | None = None) -> int:
        """Prepare descriptors of a loaded peer, of ``mem_type`` (default: the agent's);
        returns a handle."""
        kind = self._kind(mem_type)
        if remote_name not in self._remotes:
            raise KeyError(
                f"agent {self.name}: peer {remote_name!r} is not loaded; add_remote first"
            )
        return self._prep(remote_name, as_xfer_descs(descs), kind)

    def _prep(self, remote_name: str, descs: npt.NDArray[np.uint64], mem_type: MemType) -> int:
        native = self._agent.prep_xfer_dlist(remote_name, descs, mem_type)
        handle = self._next_dlist
        self._next_dlist += 1
        self._dlists[handle] = PreparedList(native, descs, remote_name)
        return handle

    def release_dlist(self, handle: int) -> None:
        prepared = self._dlists.pop(handle, None)
        if prepared is not None:
            prepared.native.release()

    def post(
        self,
        op: Op,
        local_handle: int,
        local_idx: npt.ArrayLike,
        remote_handle: int,
        remote_idx: npt.ArrayLike,
        notif: bytes = b"",
        *,
        stall_timeout_s: float | None = None,
        tag: object = None,
    ) -> Transfer:
        """Post a READ or WRITE of ``local[local_idx[i]] <-> remote[remote_idx[i]]``.

        The notification reaches the peer once the data has landed. On the
        CMA path the copy runs inside this call. Raises ``TransferFailed`` if
        NIXL refuses the request or the peer is gone.
        """
        if op not in ("READ", "WRITE"):
            raise ValueError(f"op must be 'READ' or 'WRITE', got {op!r}")
        local, remote = self._dlists[local_handle], self._dlists[remote_handle]
        if local.remote_name or not remote.remote_name:
            raise ValueError(
                "post needs a local handle (prep_local) and a remote one (prep_remote)"
            )
        lidx, ridx = as_index_array(local_idx, len(local)), as_index_array(remote_idx, len(remote))
        if len(lidx) != len(ridx) or len(lidx) == 0:
            raise ValueError(
                f"index arrays must be equal and non-empty, got {len(lidx)} and {len(ridx)}"
            )
        lengths = local.descs[lidx, 1]
        if not np.array_equal(lengths, remote.descs[ridx, 1]):
            raise ValueError("paired local and remote descriptors differ in length")
        posted_at = time.monotonic()
        try:
            handle = self._agent.make_prepped_xfer(
                op, local.native, lidx, remote.native, ridx, notif
            )
        except nixl_import.NIXL_ERRORS as exc:
            raise TransferFailed(
                f"{op} to {remote.remote_name}: request refused: {describe(exc)}"
            ) from exc
        transfer = Transfer(
            op=op,
            remote_name=remote.remote_name,
            nbytes=int(lengths.sum()),
            desc_count=len(lidx),
            notif=notif,
            posted_at=posted_at,
            handle=handle,
            deadline=posted_at + stall_timeout_s if stall_timeout_s is not None else math.inf,
            tag=tag,
        )
        self._advance(transfer, lambda: self._agent.transfer(handle, notif))
        return transfer

    def poll(self, transfer: Transfer) -> Literal["DONE", "PROC"]:
        """Advance a transfer; raises ``TransferFailed`` if it failed (now or before)."""
        if transfer.state == "PROC":
            self._advance(transfer, lambda: self._agent.check_xfer_state(transfer.handle))
        if transfer.state == "FAILED":
            raise TransferFailed(transfer.failure or "failed")
        return "DONE" if transfer.state == "DONE" else "PROC"

    def _advance(self, transfer: Transfer, step: Any) -> None:
        try:
            status = step()
        except nixl_import.NIXL_ERRORS as exc:
            self.abort(transfer, describe(exc))
            raise TransferFailed(transfer.failure or "") from exc
        if status == "DONE":
            transfer.state = "DONE"
            transfer.telemetry = self._telemetry(transfer)
        elif status != "PROC":
            self.abort(transfer, f"NIXL returned status {status!r}")
            raise TransferFailed(transfer.failure or "")

    def _telemetry(self, transfer: Transfer) -> TransferTelemetry | None:
        if not self.config.capture_telemetry:
            return None
        try:
            return TransferTelemetry.from_native(self._agent.get_xfer_telemetry(transfer.handle))
        except nixl_import.NIXL_ERRORS:
            return None

    def abort(self, transfer: Transfer, reason: str) -> None:
        """Mark a transfer failed and release (cancel) it; a finished one is left alone."""
        if transfer.state == "PROC":
            transfer.state = "FAILED"
            transfer.failure = f"{transfer.op} with {transfer.remote_name} failed: {reason}"
        self.release(transfer)

    def release(self, transfer: Transfer) -> None:
        """Free the request; idempotent and never raises (a refused release is retried at close)."""
        if transfer.released:
            return
        try:
            transfer.handle.release()
        except nixl_import.NIXL_ERRORS as exc:
            logger.warning("agent %s: releasing %s failed: %s", self.name, transfer, describe(exc))
            if transfer not in self._unreleased:
                self._unreleased.append(transfer)
            return
        transfer.released = True
        if transfer in self._unreleased:
            self._unreleased.remove(transfer)

    def connect(self, remote_name: str) -> None:
        """Start the transport's wire-up with a loaded peer now (it completes as both sides
        progress), rather than on the first transfer or notification."""
        try:
            self._agent.make_connection(remote_name)
        except nixl_import.NIXL_ERRORS as exc:
            raise TransferFailed(f"connection to {remote_name} failed: {describe(exc)}") from exc

    def send_notif(self, remote_name: str, msg: bytes) -> None:
        try:
            self._agent.send_notif(remote_name, msg)
        except nixl_import.NIXL_ERRORS as exc:
            raise TransferFailed(f"notification to {remote_name} failed: {describe(exc)}") from exc

    def get_notifs(self) -> dict[str, list[bytes]]:
        """Drain notifications by sender name; also drives progress without a progress thread."""
        self.progress()
        out, self._pending_notifs = self._pending_notifs, {}
        return out

    def progress(self) -> None:
        """Drive UCX once (without a progress thread peers wait on it: wireups, notifications);
        notifications that arrive are kept for the next `get_notifs`."""
        raw = self._agent.get_new_notifs()
        for key, msgs in raw.items():
            if msgs:
                self._pending_notifs.setdefault(key.decode() if isinstance(key, bytes) else str(key),
                                                []).extend(msgs)

    def close(self) -> None:
        """Release lists, forget peers, deregister memory; the agent is unusable afterwards."""
        for transfer in list(self._unreleased):
            self.release(transfer)
        for handle in list(self._dlists):
            self.release_dlist(handle)
        for name in list(self._remotes):
            self.remove_remote(name)
        self.deregister_all()

    def __enter__(self) -> NixlAgent:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
