"""Peer side: one connector worker (one TP rank of a P or D engine) serving JSON-line commands.

The process owns a `NixlWorker` on its main thread (NIXL agents are not thread-safe).
A thread reads stdin into a queue; the main loop handles commands and, between
them, calls `get_finished()` about every millisecond, reporting every non-empty
output as an event. Subclasses own the KV memory and add commands.

Protocol stream: the original stdout. File descriptor 1 is pointed at stderr before
NIXL loads, so nothing a native library prints can corrupt the JSON lines.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import IO, Any

from kvlink.connector.api import StepMetadata
from kvlink.connector.config import ConnectorConfig
from kvlink.connector.worker import NixlWorker
from kvlink.layout.conv_state import conv_layouts, with_conv_layouts
from kvlink.layout.presets import preset
from kvlink.layout.spec import ModelSpec

Handler = Callable[[dict[str, Any]], dict[str, Any]]
_EOF = object()
ACTIVE_POLL_S = 0.001
IDLE_POLL_S = 0.005


def model_from_config(cfg: dict[str, Any]) -> ModelSpec:
    """A preset by name, optionally with fields replaced (`model_overrides`), cut to `layers`
    or with its SSM conv state in `conv_layout`."""
    model = preset(str(cfg.get("model", "hybrid-mamba2")))
    overrides = dict(cfg.get("model_overrides") or {})
    if cfg.get("layers"):
        overrides["layer_groups"] = tuple(model.layer_groups[: int(cfg["layers"])])
    if "layer_groups" in overrides:
        overrides["layer_groups"] = tuple(overrides["layer_groups"])
    model = dataclasses.replace(model, **overrides) if overrides else model
    if cfg.get("conv_layout"):  # an engine keeping its SSM conv state in another layout
        model = with_conv_layouts(model, dict.fromkeys(conv_layouts(model), cfg["conv_layout"]))
    return model


def connector_config(cfg: dict[str, Any]) -> ConnectorConfig:
    return ConnectorConfig(
        engine_id=str(cfg["engine_id"]), side_channel_port=int(cfg.get("port", 0)),
        side_channel_host=str(cfg.get("host", "127.0.0.1")),
        lease_s=float(cfg.get("lease_s", 30.0)), stall_timeout_s=float(cfg.get("stall_timeout_s", 10.0)),
        handshake_timeout_s=float(cfg.get("handshake_timeout_s", 5.0)),
        transfer_mode=cfg.get("transfer_mode", "pull"),
        separate_notifier=bool(cfg.get("separate_notifier", True)),
        verify_kv=str(cfg.get("verify_kv", ConnectorConfig.verify_kv)),
    )


class _LogCapture(logging.Handler):
    """Keeps WARNING+ records of kvlink loggers so the driver can assert on failure reasons."""

    def __init__(self, limit: int = 500) -> None:
        super().__init__(logging.WARNING)
        self.records: list[str] = []
        self.limit = limit

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.records) < self.limit:
            self.records.append(f"{record.name}: {record.getMessage()}")


class PeerServer:
    """Generic peer: builds the worker from `cfg`; subclasses call `start(base_addrs, nbytes)`."""

    def __init__(self, cfg: dict[str, Any], out: IO[str]) -> None:
        self.cfg = cfg
        self.out = out
        self.model = model_from_config(cfg)
        self.tp_size, self.tp_rank = int(cfg.get("tp", 1)), int(cfg.get("rank", 0))
        self.block_size = int(cfg.get("block_size", 16))
        self.kernel_block_size = int(cfg.get("kernel_block_size", self.block_size))
        self.num_blocks = int(cfg.get("num_blocks", 64))
        self.config = connector_config(cfg)
        # `memory: "cuda"`: the KV are GPU tensors, registered as NIXL VRAM (see transfer_node)
        self.worker = NixlWorker(self.config, self.model, self.tp_size, self.tp_rank, self.block_size,
                                 self.kernel_block_size, self.num_blocks,
                                 mem_type="VRAM" if cfg.get("memory") == "cuda" else "DRAM")
        self.commands: dict[str, Handler] = {
            "ping": lambda a: {"pid": os.getpid()},
            "step": self.cmd_step,
            "state": self.cmd_state,
            "stats": self.cmd_stats,
            "logs": lambda a: {"records": list(self.logs.records)},
            "exit": self.cmd_exit,
        }
        self.counters: dict[str, int] = {}
        self.transfers: list[dict[str, Any]] = []
        self.totals: dict[str, list[Any]] = {"finished_recving": [], "failed_recving": [],
                                              "finished_sending": [], "invalid_block_ids": []}
        self.logs = _LogCapture()
        logging.getLogger("kvlink").addHandler(self.logs)
        self._inbox: queue.Queue[Any] = queue.Queue()
        self._stopping = False
        self._last_command = time.monotonic()
        self.active_poll_s = float(cfg.get("active_poll_s", ACTIVE_POLL_S))

    def start(self, base_addrs: list[int], nbytes: list[int]) -> None:
        self.worker.register_kv_caches(base_addrs, nbytes)

    # ---- protocol -----------------------------------------------------------------------
    def emit(self, msg: dict[str, Any]) -> None:
        self.out.write(json.dumps(msg, separators=(",", ":")) + "\n")
        self.out.flush()

    def _read_stdin(self) -> None:
        for line in sys.stdin:
            self._inbox.put(line)
        self._inbox.put(_EOF)

    def run(self) -> None:
        threading.Thread(target=self._read_stdin, name="peer-stdin", daemon=True).start()
        self.emit({"event": "ready", "port": self.worker.side_channel_port, "pid": os.getpid(),
                   "agent": self.worker.agent.name if self.worker.agent else None})
        try:
            while not self._stopping:
                busy = self.worker.has_inflight() or time.monotonic() - self._last_command < 0.2
                try:
                    item = self._inbox.get(timeout=self.active_poll_s if busy else IDLE_POLL_S)
                except queue.Empty:
                    item = None
                if item is _EOF:
                    break
                if item is not None:
                    self._handle(item)
                self.poll()
        finally:
            self.shutdown()

    def _handle(self, line: str) -> None:
        self._last_command = time.monotonic()
        try:
            msg = json.loads(line)
            ident = msg.pop("id")
            cmd = msg.pop("cmd")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            self.emit({"id": None, "ok": False, "error": f"bad command line: {exc}"})
            return
        handler = self.commands.get(cmd)
        if handler is None:
            self.emit({"id": ident, "ok": False, "error": f"unknown command {cmd!r}"})
            return
        try:
            result = handler(msg)
        except Exception as exc:
            self.emit({"id": ident, "ok": False,
                       "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}"})
            return
        self.emit({"id": ident, "ok": True, "result": result})

    # ---- polling ------------------------------------------------------------------------
    def poll(self) -> None:
        out = self.worker.get_finished()
        if not (out.finished_recving or out.failed_recving or out.finished_sending or out.invalid_block_ids):
            return
        msg = {"event": "output", "t": time.monotonic(),
               "finished_recving": sorted(out.finished_recving), "failed_recving": sorted(out.failed_recving),
               "finished_sending": sorted(out.finished_sending),
               "invalid_block_ids": sorted(out.invalid_block_ids),
               "load_failures": {rid: getattr(f, "reason", str(f))
                                 for rid, f in getattr(out, "load_failures", {}).items()}}
        for key, values in self.totals.items():
            values.extend(msg[key])  # type: ignore[arg-type]
        self._take_stats()
        self.emit(msg)

    def _take_stats(self) -> None:
        snap = self.worker.get_stats()
        self.counters = dict(snap["counters"])
        self.transfers += snap["transfers"]

    # ---- commands -----------------------------------------------------------------------
    def cmd_step(self, args: dict[str, Any]) -> dict[str, Any]:
        meta = StepMetadata(**{k: list(args.get(k, [])) for k in
                               ("loads", "saves", "notify_only", "frees", "heartbeats")})
        t0, c0 = time.perf_counter(), time.thread_time()
        self.worker.start_load_kv(meta)
        return {"wall_s": time.perf_counter() - t0, "cpu_s": time.thread_time() - c0}

    def cmd_state(self, args: dict[str, Any]) -> dict[str, Any]:
        w = self.worker
        listener = w.server.stats if w.server is not None else None
        now = time.monotonic()
        return {
            **w.debug_state(),
            "lease_ids": sorted(w.leases.leases),
            "lease_left_s": {r: lease.deadline - now for r, lease in w.leases.leases.items()},
            "expired_total": w.leases.expired_total,
            "handshakes_started": w.handshakes.started,
            "listener": dataclasses.asdict(listener) if listener is not None else None,
            "port": w.side_channel_port,
            "totals": self.totals,
        }

    def cmd_stats(self, args: dict[str, Any]) -> dict[str, Any]:
        self._take_stats()
        transfers = self.transfers
        if args.get("reset"):
            self.transfers = []
        return {"counters": self.counters, "transfers": transfers}

    def cmd_exit(self, args: dict[str, Any]) -> dict[str, Any]:
        self._stopping = True
        return {}

    def shutdown(self) -> None:
        self.worker.shutdown()


def protocol_stream() -> IO[str]:
    """Keep the real stdout for JSON lines; point fd 1 (and `sys.stdout`) at stderr."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return proto


def configure_logging(cfg: dict[str, Any]) -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s {cfg.get('engine_id')}-r{cfg.get('rank', 0)} "
                               "%(levelname)s %(name)s: %(message)s")
