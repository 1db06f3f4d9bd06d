"""`kvlink bench transfer`: connector pull (or push) between P and D worker processes on loopback,
against a bare NIXL pair moving the same bytes, NIXL over the connector's own descriptors
(pull), and a single-process numpy copy.

Machine noise here is of the order of the differences measured, so every size runs in
rounds: one request through the connector and each baseline on the same block ids, in an
order rotated each round; ratios are taken within a round and their median reported.

Every figure comes from one run on this machine. Sizes are the shipped tokens of one
request; the KV pool of each side holds the largest request, and the layer count is
cut (the same for every size) so that one side's pool stays under `max_gib`.

`memory="cuda"` puts both sides' KV in GPU memory (torch CUDA tensors on device 0,
registered with NIXL as VRAM) and times a device-to-device torch copy instead of the numpy
one. The connector's KV digests read pages through host pointers, so that needs `verify_kv="off"`.

`verify_kv` may name several modes ("off,sample,full"): then one D engine per mode reads
from the same P, and each round times every one of them next to the others, so the cost
of the KV check is a per-round ratio against the first mode, like the baselines.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvlink.bench.transfer_proc import (
    PeerProcess,
    call_all,
    peer_env,
    python_argv,
    stop_all,
)
from kvlink.bench.transfer_report import progress_line
from kvlink.bench.transfer_stats import load_figures, ratios, summarize
from kvlink.connector.api import RequestView
from kvlink.connector.config import VERIFY_MODES, ConnectorConfig
from kvlink.connector.scheduler import NixlScheduler
from kvlink.connector.secret import new_secret
from kvlink.layout.geometry import build_worker_geometry, packed_base_addrs
from kvlink.layout.limits import (
    BLOCK_SIZE,
    COUNT,
    MAX_MODEL_DIM,
    SECONDS_OR_ZERO,
    SEED,
    TOKENS,
    TP,
    check,
    float_range,
    int_range,
)
from kvlink.layout.presets import preset
from kvlink.plan.compat import side_problems
from kvlink.procs.launcher import free_port
from kvlink.transfer.framing import SECRET_ENV

NODE = "kvlink.bench.transfer_node"
MAX_GIB = float_range(1 / 1024, 1024.0)
"""--max-gib: one side's KV pool."""
MEMORY_KINDS = ("cpu", "cuda")
"""--memory: where each side's KV lives (host memory, NIXL DRAM; GPU 0, NIXL VRAM)."""
Log = Callable[[str], None]


@dataclass
class BenchOptions:
    preset: str = "llama3-8b"
    tokens: list[int] = field(default_factory=lambda: [512, 4096, 32768])
    p_tp: int = 1
    d_tp: int = 1
    mode: str = "pull"
    block_size: int = 16
    verify_kv: str = ConnectorConfig.verify_kv  # one mode, or several comma-separated (one D each)
    repeats: int = 9
    min_seconds: float = 1.0
    max_rounds: int = 60
    max_gib: float = 2.0
    layers: int | None = None
    seed: int = 0
    p_netns: str | None = None  # run P's workers in this network namespace (`ip netns exec`)
    d_netns: str | None = None
    p_host: str = "127.0.0.1"  # where P's side channel listens (and D reaches it)
    d_host: str = "127.0.0.1"
    memory: str = "cpu"  # MEMORY_KINDS

    def __post_init__(self) -> None:
        if not self.tokens:
            raise ValueError("--tokens: expected at least one token count")
        for tokens in self.tokens:
            check("--tokens", tokens, TOKENS)
        for name, value, bound in (
            ("--p-tp", self.p_tp, TP), ("--d-tp", self.d_tp, TP), ("--block-size", self.block_size, BLOCK_SIZE),
            ("--repeats", self.repeats, COUNT), ("max_rounds", self.max_rounds, COUNT),
            ("--min-seconds", self.min_seconds, SECONDS_OR_ZERO), ("--max-gib", self.max_gib, MAX_GIB),
            ("--layers", self.layers, int_range(1, MAX_MODEL_DIM, allow_none=True)), ("seed", self.seed, SEED),
        ):
            check(name, value, bound)
        if self.mode not in ("pull", "push"):
            raise ValueError(f"--mode must be pull or push, got {self.mode!r}")
        if self.memory not in MEMORY_KINDS:
            raise ValueError(f"--memory must be one of {', '.join(MEMORY_KINDS)}, got {self.memory!r}")
        if not isinstance(self.verify_kv, str):
            raise ValueError(f"--verify-kv: expected a string of modes, got {self.verify_kv!r}")
        modes = self.verify_modes
        bad = [m for m in modes if m not in VERIFY_MODES]
        if not modes or bad or len(set(modes)) != len(modes):
            raise ValueError(f"--verify-kv: expected one or more of {', '.join(VERIFY_MODES)}, comma-separated, "
                             f"each once; got {self.verify_kv!r}")
        if self.memory == "cuda" and modes != ["off"]:
            raise ValueError(f"--memory cuda needs --verify-kv off (got {self.verify_kv}): the connector's "
                             "KV digests read the pages through host pointers, which GPU memory is not")
        for side, netns, host in (("p", self.p_netns, self.p_host), ("d", self.d_netns, self.d_host)):
            if netns is not None and host.startswith("127."):
                raise ValueError(f"--{side}-netns {netns}: expected --{side}-host, an address of that "
                                 f"namespace the other side can reach; got {host} (loopback)")

    @property
    def verify_modes(self) -> list[str]:
        """The D engines' `verify_kv` modes, in the order given (the first is the others' baseline)."""
        return [m.strip() for m in self.verify_kv.split(",")] if self.verify_kv else []

    @property
    def p_verify_kv(self) -> str:
        """P's mode: it seals its blocks when any D checks them (`sample` and `full` seal alike)."""
        return next((m for m in self.verify_modes if m != "off"), "off")


def per_layer_token_bytes(options: BenchOptions) -> int:
    """KV bytes of one token in one layer at TP 1 (from the layout itself: block of one token)."""
    model = preset(options.preset)
    geo = build_worker_geometry(model, 1, 0, 1, 1, 1, packed_base_addrs(model, 1, 1, 1, 1, 0))
    return sum(r.page_len for r in geo.regions) // model.num_layers


def plan_sizes(options: BenchOptions) -> dict[str, Any]:
    """Pool blocks and layers for this run (same for every size)."""
    model = preset(options.preset)
    if any(g.kind not in ("full", "mla") for g in model.groups):
        raise ValueError("bench transfer supports attention and MLA presets (llama3-8b, smollm2-135m, deepseek-mla)")
    problems = side_problems("--p-tp", model, options.p_tp, options.block_size, options.block_size)
    problems += side_problems("--d-tp", model, options.d_tp, options.block_size, options.block_size)
    if problems:
        raise ValueError(f"{options.preset}: " + "; ".join(problems))
    pool = math.ceil((max(options.tokens) + 1) / options.block_size) + 1
    per_layer = per_layer_token_bytes(options) * options.block_size * pool
    cap = int(options.max_gib * 2**30 // per_layer)
    if cap < 1:
        raise ValueError(f"--tokens {max(options.tokens)}: one layer's pool ({pool} blocks of {options.block_size} "
                         f"tokens) takes {per_layer / 2**30:.2f} GiB per side, over --max-gib {options.max_gib:g}; "
                         "raise --max-gib or ask for fewer tokens")
    layers = min(model.num_layers, options.layers or model.num_layers, cap)
    return {"pool_blocks": pool, "layers": layers, "model_layers": model.num_layers,
            "side_bytes": per_layer * layers, "token_bytes": per_layer_token_bytes(options) * layers}


def cuda_unavailable() -> str | None:
    """Why `--memory cuda` cannot run here, or None when torch sees a CUDA device."""
    try:
        import torch
    except ImportError as exc:
        return f"--memory cuda needs torch with CUDA, and torch cannot be imported ({exc})"
    if not torch.cuda.is_available():
        return (f"--memory cuda needs a CUDA device, and torch {torch.__version__} sees none "
                f"(torch.version.cuda={torch.version.cuda}); use --memory cpu")
    return None


def memcpy_gbps(nbytes: int, repeats: int, memory: str = "cpu") -> dict[str, float]:
    """Median time and rate of one copy of `nbytes` in one process: numpy in host memory, or
    (memory="cuda") a torch device-to-device copy on GPU 0, synchronized."""
    if memory == "cuda":
        return _cuda_copy_gbps(nbytes, repeats)
    src = np.empty(nbytes, dtype=np.uint8)
    dst = np.empty(nbytes, dtype=np.uint8)
    src.fill(1)
    dst.fill(2)  # touch every page before timing
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    best = statistics.median(times)
    return {"s": best, "gbps": nbytes / best / 1e9}


def _cuda_copy_gbps(nbytes: int, repeats: int) -> dict[str, float]:
    import torch

    src = torch.full((nbytes,), 1, dtype=torch.uint8, device="cuda:0")
    dst = torch.full((nbytes,), 2, dtype=torch.uint8, device="cuda:0")
    dst.copy_(src)  # warm-up
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del src, dst
    torch.cuda.empty_cache()
    best = statistics.median(times)
    return {"s": best, "gbps": nbytes / best / 1e9}


def memcpy_label(memory: str) -> str:
    return "torch cuda copy" if memory == "cuda" else "numpy memcpy"


class _Side:
    """The P or D engine of the benchmark: tp worker processes and a scheduler side."""

    def __init__(self, engine_id: str, tp: int, options: BenchOptions, sizes: dict[str, Any],
                 log_dir: Path, fill: str, env: dict[str, str], secret: str, verify_kv: str,
                 host: str = "127.0.0.1", netns: str | None = None) -> None:
        self.engine_id, self.tp, self.verify_kv = engine_id, tp, verify_kv
        self.port = free_port(tp)
        prefix = ["ip", "netns", "exec", netns] if netns else []
        # In a namespace UCX uses the link the side channel is on, nothing else.
        self.netns_device = (netns, device_of(netns, host)) if netns else None
        side_env = {"UCX_NET_DEVICES": self.netns_device[1]} if self.netns_device else {}
        cfg = {"engine_id": engine_id, "tp": tp, "port": self.port, "host": host, "model": options.preset,
               "layers": sizes["layers"], "block_size": options.block_size,
               "num_blocks": sizes["pool_blocks"], "fill": fill, "lease_s": 120.0,
               "stall_timeout_s": 60.0, "transfer_mode": options.mode, "verify_kv": verify_kv,
               "active_poll_s": float(os.environ.get("KVLINK_BENCH_POLL_S", "0.001")),
               "memory": options.memory}
        self.peers = [
            PeerProcess([*prefix, *python_argv(NODE, {**cfg, "rank": r})], f"{engine_id}-r{r}",
                        env=peer_env({**side_env, **(env if r == 0 else {}), SECRET_ENV: secret}),
                        log_path=log_dir / f"{engine_id}-r{r}.log")
            for r in range(tp)
        ]
        self.sched = NixlScheduler(ConnectorConfig(engine_id, side_channel_port=self.port,
                                                   side_channel_host=host, lease_s=120.0,
                                                   transfer_mode=options.mode,  # type: ignore[arg-type]
                                                   verify_kv=verify_kv,
                                                   secret=secret.encode()), tp)


def device_of(netns: str, address: str) -> str:
    """The interface that carries `address` inside network namespace `netns`."""
    out = subprocess.run(["ip", "netns", "exec", netns, "ip", "-o", "addr", "show", "to", address],
                         capture_output=True, text=True, timeout=10)
    fields = out.stdout.split()
    if out.returncode != 0 or len(fields) < 2:
        raise ValueError(f"network namespace {netns}: expected an interface with address {address}; "
                         f"`ip addr` found none ({out.stderr.strip() or 'no such address'}); "
                         "give the address of the namespace's end of the P-D link")
    return fields[1].split("@")[0]


def _ucx_get_protocol(log: str) -> str:
    """What UCX chose for remote reads between processes, from UCX_PROTO_INFO tables (peers in
    two network namespaces are "inter-node" to UCX, on one host "intra-node")."""
    found: list[str] = []
    lines = log.splitlines()
    for i, line in enumerate(lines):
        if "remote memory read by ucp_get" in line and ("intra-node" in lines[i - 1]
                                                         or "inter-node" in lines[i - 1]):
            for row in lines[i + 4:i + 12]:
                cells = [c.strip() for c in row.split("|")[1:-1]]
                if len(cells) != 3 or not cells[0]:
                    break
                if cells[0][0].isdigit():
                    found.append(f"{cells[0]} {cells[1]} via {cells[2]}")
    return "; ".join(dict.fromkeys(found)) or "unknown (no UCX_PROTO_INFO table found)"


def run_bench(options: BenchOptions, log: Log = print) -> dict[str, Any]:
    sizes = plan_sizes(options)
    if options.memory == "cuda" and (why := cuda_unavailable()) is not None:
        raise RuntimeError(why)
    token_bytes = sizes["token_bytes"]
    log(f"kvlink bench transfer: {options.preset}, {sizes['layers']}/{sizes['model_layers']} layers, "
        f"TP {options.p_tp} -> {options.d_tp}, mode {options.mode}, block {options.block_size}, "
        f"pool {sizes['pool_blocks']} blocks = {sizes['side_bytes'] / 2**30:.2f} GiB per side, "
        f"{token_bytes / 1024:g} KiB/token, KV in {_memory_words(options.memory)}, "
        f"verify-kv {options.verify_kv}")
    log(f"UCX_TLS={os.environ.get('UCX_TLS', '<unset: UCX default>')} "
        f"UCX_NET_DEVICES={os.environ.get('UCX_NET_DEVICES', '<unset>')}")
    memcpy = {}
    for tokens in options.tokens:
        memcpy[tokens] = memcpy_gbps(tokens * token_bytes, options.repeats, options.memory)
        log(f"  {memcpy_label(options.memory)} {tokens:>6} tokens ({tokens * token_bytes / 2**20:8.1f} MiB): "
            f"{memcpy[tokens]['gbps']:.2f} GB/s")
    log_dir = Path(tempfile.mkdtemp(prefix="kvlink-bench-transfer-"))
    ucx_env = {"UCX_PROTO_INFO": "y"}
    started = time.perf_counter()
    secret = new_secret()  # one deployment: P and D sign their params and notifications with it
    p = _Side("benchP", options.p_tp, options, sizes, log_dir, "pattern", {}, secret, options.p_verify_kv,
              options.p_host, options.p_netns)
    modes = options.verify_modes
    ds = [_Side("benchD" if i == 0 else f"benchD-{mode}", options.d_tp, options, sizes, log_dir, "fill",
                ucx_env if i == 0 else {}, secret, mode, options.d_host, options.d_netns)
          for i, mode in enumerate(modes)]
    if len(ds) > 1:
        log(f"  one D engine per verify-kv mode ({', '.join(modes)}), each with its own pool, reading "
            f"from the same P; costs are per-round time ratios against {modes[0]}")
    for side in (p, *ds):
        if side.netns_device:
            log(f"  {side.engine_id} in network namespace {side.netns_device[0]}, "
                f"UCX_NET_DEVICES={side.netns_device[1]}")
    peers = p.peers + [peer for d in ds for peer in d.peers]
    try:
        for peer in peers:
            peer.wait_ready(120.0)
        log(f"  {len(peers)} worker processes ready in {time.perf_counter() - started:.1f} s (logs: {log_dir})")
        runner = _Runner(options, sizes, p, ds, log)
        result = runner.run(memcpy)
        result["ucx_get_protocol"] = _ucx_get_protocol(ds[0].peers[0].log_tail(2_000_000))
        result["ucx_tls"] = os.environ.get("UCX_TLS", "")
        result["memcpy_label"] = memcpy_label(options.memory)
        log(f"  UCX remote-read protocol (D rank 0): {result['ucx_get_protocol']}")
        return result
    finally:
        stop_all(peers)


def _memory_words(memory: str) -> str:
    return "GPU memory (cuda:0, NIXL VRAM)" if memory == "cuda" else "host memory (NIXL DRAM)"


class _Runner:
    def __init__(self, options: BenchOptions, sizes: dict[str, Any], p: _Side, ds: list[_Side], log: Log) -> None:
        self.o, self.sizes, self.p, self.ds, self.log = options, sizes, p, ds, log
        self.d = ds[0]  # the first mode's D: it also runs the baselines
        self.rng = np.random.default_rng(options.seed)
        self.count = 0

    def _ids(self, tokens: int, layout: str) -> tuple[list[int], list[int]]:
        n = math.ceil((tokens + 1) / self.o.block_size)
        pool = self.sizes["pool_blocks"]
        if layout == "contiguous":
            return list(range(n)), list(range(n))
        return ([int(x) for x in self.rng.permutation(pool)[:n]],
                [int(x) for x in self.rng.permutation(pool)[:n]])

    def prepare(self, tokens: int, p_ids: list[int], d_ids: list[int], d: _Side | None = None) -> dict[str, Any]:
        """P finishes the request and holds its blocks; D's scheduler side allocates and
        returns the load entry its workers would get (nothing moves yet)."""
        d = d or self.d
        self.count += 1
        rid = f"r{self.count}"
        prompt = list(range(tokens + 1))
        _, params = self.p.sched.request_finished(RequestView(rid, prompt, {"do_remote_decode": True}),
                                                  [p_ids], aborted=False)
        assert params is not None
        step = dataclasses.asdict(self.p.sched.build_step_metadata())
        if d.verify_kv == "off":  # as from a P that checks nothing: this request is not sealed
            for save in step["saves"]:
                save.pop("token_ids", None)
                save.pop("num_tokens", None)
        call_all(self.p.peers, "step", **step)
        view = RequestView(f"d-{rid}", prompt, params)
        d.sched.on_new_request(view)
        count, _ = d.sched.get_num_new_matched_tokens(view, 0)
        d.sched.update_state_after_alloc(view, [d_ids], count, 0)
        (entry,) = d.sched.build_step_metadata().loads
        entry["_bench_rid"] = rid
        return entry

    def request(self, tokens: int, p_ids: list[int], d_ids: list[int], d: _Side | None = None) -> dict[str, Any]:
        """One whole request: prepare, then `load`."""
        return self.load(self.prepare(tokens, p_ids, d_ids, d), d)

    def load(self, entry: dict[str, Any], d: _Side | None = None) -> dict[str, Any]:
        """Every D rank loads the prepared request through the connector (timed); P frees it."""
        rid = entry.pop("_bench_rid")
        results = call_all((d or self.d).peers, "load_timed", timeout_s=120.0, entry=entry)
        bad = [r["status"] for r in results if r["status"] != "done"]
        if bad:
            raise RuntimeError(f"load {rid} did not finish: {bad}")
        self.p.peers[0].wait_until(lambda: all(peer.sent([rid]) for peer in self.p.peers), 30.0,
                                   what=f"P frees {rid}")
        if self.o.mode == "push":  # P's workers did the WRITEs: their records carry the figures
            p_records = [t for peer in self.p.peers for t in peer.call("stats", reset=True)["transfers"]
                         if t["request_id"] == rid]
            for r in results:
                r["nbytes"] = sum(int(t["nbytes"]) for t in p_records) // self.o.d_tp
                r["descriptors"] = sum(int(t["descriptors"]) for t in p_records) // self.o.d_tp
        return load_figures(results)

    def run(self, memcpy: dict[int, dict[str, float]]) -> dict[str, Any]:
        o = self.o
        first_ids = self._ids(o.tokens[0], "contiguous")
        first = self.request(o.tokens[0], *first_ids)
        again = self.request(o.tokens[0], *first_ids)
        # the handshake is what the first request spent outside NIXL's copy, beyond a warm one
        handshake_s = (first["wall_s"] - first["nixl_wall_s"]) - (again["wall_s"] - again["nixl_wall_s"])
        self.log(f"  first request incl. handshake {first['wall_s'] * 1e3:.1f} ms, the same again "
                 f"{again['wall_s'] * 1e3:.1f} ms -> handshake ~{handshake_s * 1e3:.1f} ms (time outside the copy)")
        for d in self.ds[1:]:  # the other modes' engines shake hands before anything is timed
            for _ in range(2):
                self.request(o.tokens[0], *first_ids, d)
        # the P ranks D rank 0 reads from (all of them when P has more ranks, else one)
        sources = self.p.peers[: max(1, self.o.p_tp // self.o.d_tp)]
        remotes = [peer.call("raw_expose") for peer in sources]
        rows = []
        for tokens in o.tokens:
            for layout in ("contiguous", "fragmented"):
                measured = self._measure(tokens, layout, remotes, memcpy[tokens])
                for row in measured:
                    self.log(progress_line(row))
                rows += measured
        return {"options": dataclasses.asdict(o), "sizes": self.sizes, "handshake_s": handshake_s,
                "first_request_s": first["wall_s"], "rows": rows, "memcpy": memcpy,
                "verify_modes": o.verify_modes}

    def _measure(self, tokens: int, layout: str, remotes: list[dict[str, Any]],
                 memcpy: dict[str, float]) -> list[dict[str, Any]]:
        """`repeats` rounds; each round times the connector (once per verify-kv mode, each
        through its own D), raw NIXL and (pull) NIXL over the first D's own descriptors on the
        same block ids, in an order rotated every round so that no method always runs first or
        after the same neighbour. The ratios are taken per round (neighbours in time see the
        same machine), then their median. One row per verify-kv mode.

        Each connector load's request is finished on P (and sealed there, unless its D runs
        with `off`) right before the load, so every mode meets P in the state its own
        deployment would: P's seal of a request just before D reads it is part of its cost."""
        modes = self.o.verify_modes
        samples: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
        raw_times: list[float] = []
        same_times: list[float] = []
        raw: dict[str, Any] = {}
        desc = 0
        methods = [*modes, "raw", *(["same"] if self.o.mode == "pull" else [])]
        rounds = self.o.repeats
        i = 0
        template: dict[str, Any] = {}
        while i < rounds:
            p_ids, d_ids = self._ids(tokens, layout)
            order = methods[i % len(methods):] + methods[:i % len(methods)]
            for method in order:
                if method in samples:
                    d = self.ds[modes.index(method)]
                    entry = self.prepare(tokens, p_ids, d_ids, d)
                    if d is self.d:
                        template = {k: v for k, v in entry.items() if k != "_bench_rid"}
                    samples[method].append(self.load(entry, d))
                elif method == "same":  # the first D's READ of this round's ids (round 0 ran it first)
                    entry = {**template, "remote_block_ids": [list(p_ids)], "local_block_ids": [list(d_ids)]}
                    same = call_all(self.d.peers, "plan_read", timeout_s=120.0, entry=entry)
                    same_times.append(max(r["wall_s"] for r in same))
                else:
                    first = samples[modes[0]][0]  # round 0 runs the first D first: its stats give the sizes
                    if not desc:
                        desc = first["rank0_nbytes"] if layout == "contiguous" else \
                            first["rank0_nbytes"] // max(1, first["rank0_descriptors"])
                    raw = self.d.peers[0].call(
                        "raw_read", timeout_s=120.0, nbytes=first["rank0_nbytes"] // desc * desc,
                        desc_bytes=desc, repeats=1, seed=tokens + len(raw_times), remotes=remotes)
                    raw_times += raw["times_s"]
            if i == 0:  # small transfers are noisy: more rounds, up to about min_seconds each
                wall = samples[modes[0]][0]["wall_s"]
                rounds = max(rounds, min(self.o.max_rounds, math.ceil(self.o.min_seconds / max(wall, 1e-6))))
            i += 1
        rows = []
        base_walls = [s["wall_s"] for s in samples[modes[0]]]
        raw_s = statistics.median(raw_times)
        for mode, d in zip(modes, self.ds, strict=True):
            # an untimed request whose pages are then compared (the raw READs overwrite D's buffer)
            p_ids, d_ids = self._ids(tokens, layout)
            self.request(tokens, p_ids, d_ids, d)
            row = summarize(tokens, layout, samples[mode], memcpy)
            row["verify_kv"] = mode
            row["verified_pages"] = self._verify(p_ids, d_ids, d)
            walls = [s["wall_s"] for s in samples[mode]]
            row.update(raw_s=raw_s, raw_gbps=row["rank0_nbytes"] / raw_s / 1e9, raw_all_s=raw_times,
                       raw_descriptors=raw["descriptors"], raw_merged=raw["merged_descriptors"],
                       raw_desc_bytes=raw["desc_bytes"])
            row.update(ratios("ratio_vs_raw", raw_times, walls))
            if same_times:
                row.update(same_s=statistics.median(same_times), same_all_s=same_times)
                row.update(ratios("ratio_vs_same", same_times, walls))
            if mode != modes[0]:  # this mode's time over the first mode's, per round
                row.update(ratios("time_vs_base", walls, base_walls))
            rows.append(row)
        return rows

    def _verify(self, p_ids: list[int], d_ids: list[int], d: _Side) -> int:
        """Compare digests of sampled pages on P and D (same TP and block size only; whole
        pages only: the last block of a request may be partly filled)."""
        if self.o.p_tp != self.o.d_tp or len(d_ids) < 2:
            return 0
        info = d.peers[0].call("info")
        picks = [(int(self.rng.integers(info["regions"])), int(self.rng.integers(len(d_ids) - 1)))
                 for _ in range(16)]
        for rank in range(self.o.d_tp):
            want = self.p.peers[rank].call("digest", pages=[(r, p_ids[i]) for r, i in picks])["digests"]
            got = d.peers[rank].call("digest", pages=[(r, d_ids[i]) for r, i in picks])["digests"]
            if want != got:
                raise RuntimeError(f"rank {rank}: moved pages differ from P's (digest mismatch)")
        return len(picks) * self.o.d_tp
