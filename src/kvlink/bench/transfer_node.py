"""Benchmark peer: one connector worker whose KV is a real page-aligned buffer, plus timing.

Commands on top of `transfer_peer.PeerServer`:

* `load_timed {entry}` (D): post one load through `start_load_kv` and poll
  `get_finished()` in a tight loop until it finishes; returns the wall time, the thread
  CPU of `start_load_kv` and of the poll that reported the request, each less the time
  spent inside NIXL's `transfer`/`check_xfer_state`/`get_new_notifs` during that very call
  (the copy runs there: inside `transfer` on the CMA path; over TCP inside whichever of
  them drives UCX's progress, in every poll), and meters of planning
  (`TransferPlan.request_ids`), posting (`NixlAgent.post`) and those NIXL calls.
* `raw_expose` (P) / `raw_read` (D): a bare `NixlAgent` pair over the same buffers, READing
  the same bytes as one descriptor, or as N equal descriptors at shuffled positions. The
  pair connects once, untimed (as the connector's handshake is timed apart).
* `plan_read {entry}` (D): the connector's own agent and prepared lists READ the entry's
  planned descriptors, without notifications, tracking or stats: what the connector adds
  on top of NIXL for the very same descriptors.
* `digest {pages}`: blake2b of (region, page) pages, to check the bytes that moved.

With `memory: "cuda"` in the config the KV buffer is a torch CUDA tensor on device 0, which
the connector's worker (`mem_type="VRAM"`, see `transfer_peer`) and the bare agent register
and prepare as NIXL VRAM; filling and digests go through host copies, outside any timed part.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import IO, Any, TypeVar

import numpy as np
import numpy.typing as npt

from kvlink.bench.transfer_peer import PeerServer, configure_logging, protocol_stream
from kvlink.connector.pull import local_tail
from kvlink.layout.geometry import build_worker_geometry, packed_base_addrs
from kvlink.transfer.agent import MemType, NixlAgent

ALIGN = 4096
CUDA_DEVICE = 0
T = TypeVar("T")


class CpuMeter:
    """Accumulates wall and thread CPU seconds spent inside wrapped callables."""

    def __init__(self) -> None:
        self.cpu_s = 0.0
        self.wall_s = 0.0
        self.calls = 0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            c0, t0 = time.thread_time(), time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.cpu_s += time.thread_time() - c0
                self.wall_s += time.perf_counter() - t0
                self.calls += 1
        return timed

    def take(self) -> dict[str, float]:
        out = {"cpu_s": self.cpu_s, "wall_s": self.wall_s, "calls": self.calls}
        self.cpu_s = self.wall_s = 0.0
        self.calls = 0
        return out


def cpu_outside(call: Callable[[], T], inner: Sequence[CpuMeter]) -> tuple[T, float]:
    """Run `call`; its result and the thread CPU it spent outside the calls `inner` meters.

    Only what those meters gathered during this call is taken off: NIXL's CPU in polls
    that are not counted (over TCP, UCX moves the bytes in every one) belongs to no window.
    """
    cpu0, inner0 = time.thread_time(), sum(m.cpu_s for m in inner)
    out = call()
    return out, (time.thread_time() - cpu0) - (sum(m.cpu_s for m in inner) - inner0)


class KvBuffer:
    """One page-aligned KV buffer: host memory (numpy) or GPU memory (a torch CUDA tensor)."""

    def __init__(self, size: int, memory: str) -> None:
        self.memory, self.nbytes = memory, size
        self.mem_type: MemType = "VRAM" if memory == "cuda" else "DRAM"
        self.device_id = CUDA_DEVICE if memory == "cuda" else 0
        if memory == "cuda":
            import torch

            self._alloc: Any = torch.empty(size + ALIGN, dtype=torch.uint8, device=f"cuda:{CUDA_DEVICE}")
            shift = (-self._alloc.data_ptr()) % ALIGN
            self.data: Any = self._alloc[shift:shift + size]
            self.addr = int(self.data.data_ptr())
        else:
            self._alloc = np.empty(size + ALIGN, dtype=np.uint8)
            shift = (-self._alloc.ctypes.data) % ALIGN
            self.data = self._alloc[shift:shift + size]
            self.addr = int(self.data.ctypes.data)

    def host_view(self) -> npt.NDArray[np.uint8]:
        """Bytes to fill, then `commit`: the buffer itself in host memory, else a host copy."""
        return self.data if self.memory == "cpu" else np.empty(self.nbytes, dtype=np.uint8)

    def commit(self, host: npt.NDArray[np.uint8]) -> None:
        """Copy what `host_view` returned into GPU memory (and wait until it is there)."""
        if self.memory == "cuda":
            import torch

            self.data.copy_(torch.from_numpy(host))
            torch.cuda.synchronize()

    def read(self, start: int, nbytes: int) -> bytes:
        """`nbytes` bytes at offset `start`, copied to host memory."""
        piece = self.data[start:start + nbytes]
        return bytes(piece.cpu().numpy().tobytes() if self.memory == "cuda" else piece.tobytes())


class BenchPeer(PeerServer):
    def __init__(self, cfg: dict[str, Any], out: IO[str]) -> None:
        super().__init__(cfg, out)
        memory = str(cfg.get("memory", "cpu"))
        if memory not in ("cpu", "cuda"):
            raise ValueError(f"memory must be cpu or cuda, got {memory!r}")
        probe = packed_base_addrs(self.model, self.tp_size, self.block_size, self.kernel_block_size,
                                  self.num_blocks, 0, align=ALIGN)
        geo = build_worker_geometry(self.model, self.tp_size, self.tp_rank, self.block_size,
                                    self.kernel_block_size, self.num_blocks, probe)
        size = max(r.end for r in geo.regions)
        self.buf = KvBuffer(size, memory)
        self._fill(str(cfg.get("fill", "pattern")))
        bases = packed_base_addrs(self.model, self.tp_size, self.block_size, self.kernel_block_size,
                                  self.num_blocks, self.buf.addr, align=ALIGN)
        self.geometry = build_worker_geometry(self.model, self.tp_size, self.tp_rank, self.block_size,
                                              self.kernel_block_size, self.num_blocks, bases,
                                              device_id=self.buf.device_id)
        self.start([r.base for r in self.geometry.regions],
                   [r.page_stride * r.num_pages for r in self.geometry.regions])
        self.meters = {k: CpuMeter() for k in ("plan", "post", "transfer", "check", "progress")}
        self._instrumented: set[int] = set()
        self.raw_agent: NixlAgent | None = None
        self._raw_remotes: dict[str, str] = {}
        self.commands.update(load_timed=self.cmd_load_timed, raw_expose=self.cmd_raw_expose,
                             raw_read=self.cmd_raw_read, digest=self.cmd_digest, info=self.cmd_info,
                             plan_read=self.cmd_plan_read)

    def _fill(self, how: str) -> None:
        """Touch every page now (so no page fault lands inside a timed transfer)."""
        host = self.buf.host_view()
        if how == "pattern":  # distinct 8-byte words, so misplaced bytes would show in digests
            words = host[: host.size // 8 * 8].view(np.uint64)
            words[:] = np.arange(words.size, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
            words ^= np.uint64(self.tp_rank + 1)
        else:
            host.fill(0x5A)
        self.buf.commit(host)

    # ---- instrumentation ----------------------------------------------------------------
    def _instrument(self) -> None:
        agent = self.worker.agent
        assert agent is not None
        if id(agent) not in self._instrumented:
            self._instrumented.add(id(agent))
            raw = agent._agent
            raw.transfer = self.meters["transfer"].wrap(raw.transfer)
            raw.check_xfer_state = self.meters["check"].wrap(raw.check_xfer_state)
            raw.get_new_notifs = self.meters["progress"].wrap(raw.get_new_notifs)
            agent.post = self.meters["post"].wrap(agent.post)  # type: ignore[method-assign]
        for engine in self.worker.engines.values():
            plan = engine.plan
            if plan is not None and id(plan) not in self._instrumented:
                self._instrumented.add(id(plan))
                object.__setattr__(plan, "request_ids", self.meters["plan"].wrap(plan.request_ids))

    def cmd_load_timed(self, args: dict[str, Any]) -> dict[str, Any]:
        entry = args["entry"]
        rid = entry["request_id"]
        timeout = float(args.get("timeout_s", 60.0))
        self._instrument()
        for meter in self.meters.values():
            meter.take()
        from kvlink.connector.api import StepMetadata

        nixl = (self.meters["transfer"], self.meters["check"], self.meters["progress"])
        t0 = time.perf_counter()
        _, start_cpu = cpu_outside(lambda: self.worker.start_load_kv(StepMetadata(loads=[entry])), nixl)
        post_wall = time.perf_counter() - t0
        polls, status = 0, "timeout"
        last_cpu = 0.0
        while time.perf_counter() - t0 < timeout:
            out, last_cpu = cpu_outside(self.worker.get_finished, nixl)
            polls += 1
            self._record(out)
            if rid in out.failed_recving:
                status = "failed"
                break
            if rid in out.finished_recving:
                status = "done"
                break
            self._instrument()  # a handshake may have just finished: time the new plan too
        wall = time.perf_counter() - t0
        meters = {k: m.take() for k, m in self.meters.items()}
        self._take_stats()
        records = [t for t in self.transfers if t["request_id"] == rid]
        return {
            "status": status, "wall_s": wall, "post_wall_s": post_wall, "start_cpu_s": start_cpu,
            "last_poll_cpu_s": last_cpu, "polls": polls, "meters": meters,
            "nbytes": sum(int(t["nbytes"]) for t in records),
            "descriptors": sum(int(t["descriptors"]) for t in records),
            "nixl_xfer_s": sum(float(t["duration_s"]) for t in records),
            "remote_engines": sorted(self.worker.engines),
        }

    def _record(self, out: Any) -> None:
        if out.finished_recving or out.failed_recving or out.finished_sending:
            msg = {"event": "output", "t": time.monotonic(),
                   "finished_recving": sorted(out.finished_recving),
                   "failed_recving": sorted(out.failed_recving),
                   "finished_sending": sorted(out.finished_sending),
                   "invalid_block_ids": sorted(out.invalid_block_ids)}
            self.emit(msg)

    def poll(self) -> None:
        super().poll()
        if self.raw_agent is not None:
            self.raw_agent.get_notifs()  # the bare agent needs progress too (no progress thread)

    # ---- raw NIXL -----------------------------------------------------------------------
    def _raw_agent(self) -> NixlAgent:
        if self.raw_agent is None:
            self.raw_agent = NixlAgent(f"raw-{self.config.engine_id}-r{self.tp_rank}",
                                       mem_type=self.buf.mem_type)
            self.raw_agent.register_regions([(self.buf.addr, self.buf.nbytes)], device_id=self.buf.device_id)
        return self.raw_agent

    def cmd_raw_expose(self, args: dict[str, Any]) -> dict[str, Any]:
        agent = self._raw_agent()
        return {"metadata": agent.metadata().hex(), "base": self.buf.addr, "size": self.buf.nbytes}

    def cmd_raw_read(self, args: dict[str, Any]) -> dict[str, Any]:
        """READ `nbytes`, split evenly over the `remotes` (exposed P buffers), into this buffer:
        one descriptor per remote, or `desc_bytes` descriptors at shuffled, never adjacent
        positions on both sides. All READs are posted, then polled to completion."""
        agent = self._raw_agent()
        remotes = args["remotes"]
        nbytes, desc = int(args["nbytes"]), int(args.get("desc_bytes") or args["nbytes"])
        per_remote = nbytes // len(remotes)
        one = desc >= per_remote
        desc = per_remote if one else desc
        count = per_remote // desc
        rng = np.random.default_rng(int(args.get("seed", 0)))
        local_slots = _spread(rng, self.buf.nbytes // desc, count * len(remotes))
        plans = []
        try:
            for i, remote in enumerate(remotes):
                name = self._raw_remote(agent, remote)
                if one:
                    local_off = np.array([i * per_remote], dtype=np.int64)
                    remote_off = np.zeros(1, np.int64)
                else:
                    local_off = local_slots[i * count:(i + 1) * count] * desc
                    remote_off = _spread(rng, int(remote["size"]) // desc, count) * desc
                dev = self.buf.device_id
                lh = agent.prep_local(_descs(self.buf.addr + local_off, desc, dev))
                rh = agent.prep_remote(name, _descs(int(remote["base"]) + remote_off, desc, dev))
                plans.append((name, lh, rh))
            idx = np.arange(count, dtype=np.int64)
            times, merged = [], 0
            for _ in range(int(args.get("repeats", 3))):
                wall, telemetry = _read_all(agent, [(lh, idx, rh, idx) for _, lh, rh in plans])
                times.append(wall)
                merged = sum(tel.desc_count if tel is not None else count for tel in telemetry)
        finally:
            for _, lh, rh in plans:  # the peer stays connected, like the connector's engines
                agent.release_dlist(lh)
                agent.release_dlist(rh)
        return {"times_s": times, "descriptors": count * len(remotes), "merged_descriptors": merged,
                "desc_bytes": desc}

    def cmd_plan_read(self, args: dict[str, Any]) -> dict[str, Any]:
        """READ a load entry's planned descriptors with the connector's own agent and prepared
        lists, but none of its bookkeeping: no notification, no tracker, no stats."""
        entry = args["entry"]
        engine = self.worker.engines[entry["remote_engine_id"]]
        agent = self.worker.agent
        assert engine.plan is not None and agent is not None
        entry = local_tail(entry, self.model, self.block_size)
        specs = engine.plan.request_ids(entry["local_block_ids"], entry["remote_block_ids"],
                                        entry["num_tokens"], entry["local_computed_tokens"])
        wall, _ = _read_all(agent, [(engine.handles[s.src_rank].local_handle, s.local_idx,
                                     engine.handles[s.src_rank].remote_handle, s.remote_idx)
                                    for s in specs if len(s.local_idx)])
        return {"wall_s": wall}

    def _raw_remote(self, agent: NixlAgent, remote: dict[str, Any]) -> str:
        """Load a bare P agent once and connect to it with one untimed 4 KiB READ, so that no
        timed READ pays for UCX's connection setup (the connector's handshake is timed apart)."""
        key = remote["metadata"]
        if key not in self._raw_remotes:
            name = agent.add_remote(bytes.fromhex(key))
            dev = self.buf.device_id
            lh = agent.prep_local(_descs(np.array([self.buf.addr], dtype=np.int64), ALIGN, dev))
            rh = agent.prep_remote(name, _descs(np.array([int(remote["base"])], dtype=np.int64), ALIGN, dev))
            idx = np.zeros(1, dtype=np.int64)
            _read_all(agent, [(lh, idx, rh, idx)])
            agent.release_dlist(lh)
            agent.release_dlist(rh)
            self._raw_remotes[key] = name
        return self._raw_remotes[key]

    def cmd_digest(self, args: dict[str, Any]) -> dict[str, Any]:
        out = []
        for region_index, page in args["pages"]:
            region = self.geometry.regions[int(region_index)]
            start = region.base - self.buf.addr + int(page) * region.page_stride
            out.append(hashlib.blake2b(self.buf.read(start, region.page_len), digest_size=16).hexdigest())
        return {"digests": out}

    def cmd_info(self, args: dict[str, Any]) -> dict[str, Any]:
        regions = self.geometry.regions
        return {"regions": len(regions), "page_len": regions[0].page_len, "buffer_bytes": self.buf.nbytes,
                "layers": self.model.num_layers}

    def shutdown(self) -> None:
        super().shutdown()
        if self.raw_agent is not None:
            self.raw_agent.close()


def _read_all(agent: NixlAgent, reads: list[tuple[int, Any, int, Any]]) -> tuple[float, list[Any]]:
    """Post every (local list, ids, remote list, ids) READ, spin until all are done, release
    them; returns the wall time from the first post to the last completion and telemetry."""
    t0 = time.perf_counter()
    posted = [agent.post("READ", lh, lidx, rh, ridx) for lh, lidx, rh, ridx in reads]
    for t in posted:
        while agent.poll(t) != "DONE":
            pass
    wall = time.perf_counter() - t0
    for t in posted:
        agent.release(t)
    return wall, [t.telemetry for t in posted]


def _spread(rng: np.random.Generator, slots: int, count: int) -> npt.NDArray[np.int64]:
    """`count` distinct slots in random order with no two neighbours (so NIXL cannot merge)."""
    if 2 * count <= slots:
        picked = rng.choice(slots // 2, size=count, replace=False).astype(np.int64) * 2
    else:
        picked = rng.permutation(slots)[:count].astype(np.int64)
    return picked


def _descs(addrs: npt.NDArray[np.int64], length: int, device_id: int = 0) -> npt.NDArray[np.uint64]:
    out = np.zeros((addrs.size, 3), dtype=np.uint64)
    out[:, 0] = addrs.astype(np.uint64)
    out[:, 1] = length
    out[:, 2] = device_id
    return out


def main() -> None:
    cfg = json.loads(sys.argv[1])
    out = protocol_stream()
    configure_logging(cfg)
    BenchPeer(cfg, out).run()


if __name__ == "__main__":
    main()
