"""Multi-process connector harness for tests.

Run as a script (`python kvpeer.py CONFIG_JSON`) it is one worker of a P or D engine:
its KV lives in a real buffer laid out like the simulator's (`kvmem.real_worker`), and
on top of the generic peer commands (`step`, `state`, `stats`, `logs`, `exit`, see
`kvlink.bench.transfer_peer`) it can `store` a request's seeded logical KV into block
ids, `snapshot` its memory and `verify` finished requests byte for byte.

Imported by pytest it is the driver: `Engine` (one P or D engine = tp peer processes
sharing an engine id and a base port), with a `NixlScheduler` of its own that builds
the step metadata exactly as an engine's scheduler side would.
"""

from __future__ import annotations

import dataclasses
import sys
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

if __name__ == "__main__":  # run as a peer process: make the sibling modules importable
    sys.path.insert(0, str(Path(__file__).parent))

import kvmem
import sim
from forge import resigned

from kvlink.bench.transfer_peer import (
    PeerServer,
    configure_logging,
    model_from_config,
    protocol_stream,
)
from kvlink.bench.transfer_proc import PeerProcess, peer_env, python_argv, stop_all
from kvlink.connector.api import RequestView, WorkerOutput
from kvlink.connector.config import ConnectorConfig
from kvlink.connector.scheduler import NixlScheduler
from kvlink.connector.secret import SECRET_ENV, new_secret
from kvlink.layout.conv_state import conv_layouts, with_conv_layouts
from kvlink.layout.spec import is_ssm
from kvlink.procs.launcher import free_port

SCRIPT = str(Path(__file__).resolve())
SECRET = new_secret()  # every engine of a test run shares it, as one deployment's P and D do
Ids = list[list[int]]


# ---------------------------------------------------------------------------------------
# peer process side
# ---------------------------------------------------------------------------------------
class SimPeer(PeerServer):
    def __init__(self, cfg: dict[str, Any], out: Any) -> None:
        super().__init__(cfg, out)
        self.mem = kvmem.real_worker(self.model, self.tp_size, self.tp_rank, self.block_size,
                                     self.kernel_block_size, self.num_blocks, seed=int(cfg.get("seed", 0)))
        self.snap = self.mem.data.copy()
        self.commands.update(store=self.cmd_store, snapshot=self.cmd_snapshot, verify=self.cmd_verify,
                             changed_blocks=self.cmd_changed_blocks)
        self.start(*kvmem.region_sizes(self.mem))

    def _logical(self, seed: int, tokens: int) -> sim.LogicalKV:
        """The request's seeded state, drawn in the DS conv layout whatever this engine keeps,
        so engines of either layout agree on it."""
        drawn = with_conv_layouts(self.model, dict.fromkeys(conv_layouts(self.model), "DS"))
        return sim.in_conv_layouts(sim.make_logical(drawn, tokens, np.random.default_rng(seed)), drawn, self.model)

    def _tokens(self, start: int, end: int) -> list[np.ndarray]:
        return [np.zeros(0, dtype=np.int64) if is_ssm(g) else np.arange(start, end, dtype=np.int64)
                for g in self.model.groups]

    def cmd_store(self, args: dict[str, Any]) -> dict[str, Any]:
        """Write the logical KV of tokens [0, tokens) (seeded) into `block_ids`."""
        ids = [np.asarray(x, dtype=np.int64) for x in args["block_ids"]]
        tokens = int(args["tokens"])
        sim.store(self.mem, self._logical(int(args["seed"]), tokens), ids, self._tokens(0, tokens))
        return {}

    def cmd_snapshot(self, args: dict[str, Any]) -> dict[str, Any]:
        self.snap = self.mem.data.copy()
        return {}

    def cmd_changed_blocks(self, args: dict[str, Any]) -> dict[str, Any]:
        """Logical blocks (per group) holding bytes that differ from the last snapshot."""
        offsets = np.flatnonzero(self.mem.data != self.snap).astype(np.int64)
        found = sim.touched_blocks(self.mem, offsets)
        return {"blocks": {str(g): sorted(b) for g, b in found.items() if b}}

    def cmd_verify(self, args: dict[str, Any]) -> dict[str, Any]:
        """Each request's tokens [computed, tokens) and SSM state are exact; nothing else changed."""
        errors: list[str] = []
        mask = np.zeros(self.mem.data.size, dtype=bool)
        for req in args["requests"]:
            ids = [np.asarray(x, dtype=np.int64) for x in req["block_ids"]]
            tokens, computed = int(req["tokens"]), int(req.get("computed", 0))
            toks = self._tokens(computed, tokens)
            got = sim.load(self.mem, ids, toks, computed)
            want = sim.expected_for(self.mem, self._logical(int(req["seed"]), tokens), toks)
            for layer, rows in want.rows.items():
                if not np.array_equal(got.rows[layer], rows):
                    bad = int((got.rows[layer] != rows).sum())
                    errors.append(f"{req.get('rid')}: layer {layer}: {bad} bytes differ")
            for key, state in want.ssm.items():
                if not np.array_equal(got.ssm[key], state):
                    errors.append(f"{req.get('rid')}: ssm {key} differs")
            mask |= sim.destination_mask(self.mem, ids)
        if args.get("check_outside", True):
            changed = int((self.mem.data[~mask] != self.snap[~mask]).sum())
            if changed:
                errors.append(f"{changed} bytes outside the destination blocks changed")
        return {"errors": errors}


def main() -> None:
    import json

    cfg = json.loads(sys.argv[1])
    out = protocol_stream()
    configure_logging(cfg)
    SimPeer(cfg, out).run()


# ---------------------------------------------------------------------------------------
# pytest side
# ---------------------------------------------------------------------------------------
class Engine:
    """One P or D engine: `tp` peer processes (rank r on port base + r) and a scheduler side."""

    def __init__(self, engine_id: str, tp: int, log_dir: Path, env: dict[str, str] | None = None,
                 **cfg: Any) -> None:
        self.engine_id, self.tp = engine_id, tp
        self.port = free_port(tp)
        self.cfg = {"engine_id": engine_id, "tp": tp, "port": self.port, **cfg}
        self.env = env
        self.peers: list[PeerProcess] = []
        try:
            for rank in range(tp):
                rank_cfg = {**self.cfg, "rank": rank, "seed": 1000 * rank + zlib.crc32(engine_id.encode()) % 997}
                self.peers.append(PeerProcess(
                    python_argv(SCRIPT, rank_cfg), f"{engine_id}-r{rank}",
                    env=peer_env({**(env or {}), SECRET_ENV: SECRET}),
                    log_path=log_dir / f"{engine_id}-r{rank}.log"))
        except BaseException:
            stop_all(self.peers)
            raise
        self.sched = NixlScheduler(ConnectorConfig(
            engine_id, side_channel_port=self.port, lease_s=float(cfg.get("lease_s", 30.0)),
            transfer_mode=cfg.get("transfer_mode", "pull"), secret=SECRET.encode(),
            verify_kv=cfg.get("verify_kv", ConnectorConfig.verify_kv)), tp,
            model=model_from_config(self.cfg))

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        for peer in self.peers:
            peer.wait_ready(timeout_s)
        ports = [peer.port for peer in self.peers]
        assert ports == [self.port + r for r in range(self.tp)], ports

    def call(self, cmd: str, timeout_s: float = 20.0, **args: Any) -> list[dict[str, Any]]:
        return [peer.call(cmd, timeout_s, **args) for peer in self.peers]

    def step(self, **meta: Any) -> list[dict[str, Any]]:
        return self.call("step", **meta)

    def stop(self) -> None:
        stop_all(self.peers)

    def signal_all(self, sig: int) -> None:
        for peer in self.peers:
            peer.signal(sig)

    # ---- P side -------------------------------------------------------------------------
    def prefill(self, rid: str, seed: int, prompt_len: int, block_ids: Ids, hold: bool = True,
                transfer_mode: str | None = None, first_token: int = 0) -> dict[str, Any]:
        """Store the request's KV on every rank and finish it (held for D); returns the params for D.
        The prompt is tokens `first_token, first_token + 1, ...`."""
        self.call("store", seed=seed, tokens=prompt_len - 1, block_ids=block_ids)
        req = RequestView(rid, list(range(first_token, first_token + prompt_len)), {"do_remote_decode": True})
        delay, params = self.sched.request_finished(req, block_ids, aborted=False)
        assert delay and params is not None
        step = self.sched.build_step_metadata()
        if hold:
            self.step(**dataclasses.asdict(step))
        if transfer_mode is not None:  # this request only: sign it again, as P would have
            params = resigned(params, SECRET, transfer_mode=transfer_mode)
        return params

    def sent(self, rids: Sequence[str]) -> bool:
        return all(peer.sent(rids) for peer in self.peers)

    # ---- D side -------------------------------------------------------------------------
    def decode(self, rid: str, params: dict[str, Any], prompt_len: int, tables: Ids,
               computed: int = 0, send: bool = True, first_token: int = 0) -> dict[str, Any]:
        """Admit a request with remote KV: scheduler side builds the load; every rank gets it."""
        req = RequestView(rid, list(range(first_token, first_token + prompt_len)), params)
        self.sched.on_new_request(req)
        count, is_async = self.sched.get_num_new_matched_tokens(req, computed)
        if count or is_async:  # a hybrid model's full hit loads the SSM state alone: (0, True)
            assert is_async
            self.sched.update_state_after_alloc(req, tables, count, computed)
        meta = dataclasses.asdict(self.sched.build_step_metadata())
        if send:
            self.step(**meta)
        return meta

    def settled(self, rids: Sequence[str]) -> bool:
        return all(peer.settled(rids) for peer in self.peers)

    def wait_settled(self, rids: Sequence[str], timeout_s: float = 20.0) -> float:
        took = self.peers[0].wait_until(lambda: self.settled(rids), timeout_s, what=f"{len(rids)} loads")
        out = WorkerOutput()
        for peer in self.peers:
            out.finished_recving |= {r for r in rids if r in peer.finished_recving}
            out.failed_recving |= {r for r in rids if r in peer.failed_recving}
        self.sched.update_connector_output(out)
        return took

    def failed(self, rids: Sequence[str]) -> set[str]:
        return {r for peer in self.peers for r in rids if r in peer.failed_recving}

    def verify(self, requests: list[dict[str, Any]], check_outside: bool = True) -> None:
        for peer in self.peers:
            errors = peer.call("verify", requests=requests, check_outside=check_outside)["errors"]
            assert not errors, f"{peer.name}: {errors[:10]}"


def start_engines(log_dir: Path, *specs: dict[str, Any]) -> list[Engine]:
    """Start every engine's processes at once (they import NIXL in parallel), then wait for all."""
    engines: list[Engine] = []
    try:
        for spec in specs:
            engines.append(Engine(log_dir=log_dir, **spec))
        for engine in engines:
            engine.wait_ready()
    except BaseException:
        stop_engines(engines)
        raise
    return engines


def stop_engines(engines: Sequence[Engine]) -> None:
    stop_all([peer for engine in engines for peer in engine.peers])


def blocks(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


def n_blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def pull_exact(p: Engine, d: Engine, rid: str, seed: int, prompt: int,
               p_ids: list[list[int]], d_ids: list[list[int]], transfer_mode: str | None = None) -> None:
    """P prefills `rid` into `p_ids`, D loads it into `d_ids`; every byte on every D rank must match."""
    d.call("snapshot")
    params = p.prefill(rid, seed, prompt, p_ids, transfer_mode=transfer_mode)
    d.decode(f"d-{rid}", params, prompt, d_ids)
    d.wait_settled([f"d-{rid}"])
    assert not d.failed([f"d-{rid}"])
    d.verify([{"rid": rid, "seed": seed, "tokens": prompt - 1, "block_ids": d_ids}])


if __name__ == "__main__":
    main()
