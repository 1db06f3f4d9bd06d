"""`kvlink bench vllm-matrix`: connectors through the support matrix's cases inside vLLM.

A cell is one row of docs/vllm.md's support matrix: a model family, P's and D's flags
(TP size, block size, extra arguments) and a kind (`pull`, `push`, or `prefix`: the prompts
share a long prefix, so D's prefix cache holds the first part of every prompt after the
first). For each connector, the cell's P and D servers are started (or reused from an
earlier cell with the same flags), each prompt is prefilled on P (`do_remote_decode`) and
decoded on D with P's `kv_transfer_params`, and each answer is sorted against colocated
vLLM with D's flags (and, where the TP sizes differ, P's too):

* exact: the same text;
* wrong text: HTTP 200 with another text;
* HTTP error: the status and the first words of the body;
* hang: no answer within the deadline (the cell stops there);
* crash: a server of the cell exited (the cell stops there);
* start failed: a server refused the configuration (the log line that says why).
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from kvlink.bench.vllm_config import reference_prompts
from kvlink.bench.vllm_measure import METRIC_PREFIX, kv_bytes_total
from kvlink.bench.vllm_servers import _pythonpath, complete
from kvlink.integrations.vllm.launch import (
    VllmServerSpec,
    kvlink_transfer_config,
    served_model,
    start_server,
    stop_servers,
    wait_ready,
)
from kvlink.procs import launcher
from kvlink.procs.launcher import Service

Progress = Callable[[str], None]
CONNECTORS = ("nixl", "kvlink")
PRIMARY = "colocated at D's flags"
SECONDARY = "colocated at P's flags"


@dataclass(frozen=True)
class Side:
    """One side's flags beyond its family's."""

    tp: int = 1
    block: int = 128
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()

    def label(self) -> str:
        extra = " ".join(self.args + tuple(f"{k}={v}" for k, v in self.env))
        return f"TP {self.tp}, block {self.block}" + (f", {extra}" if extra else "")


@dataclass(frozen=True)
class MatrixFamily:
    name: str
    model: str  # a builder in kvlink.integrations.vllm.models
    dtype: str
    args: tuple[str, ...] = ()
    about: str = ""


@dataclass(frozen=True)
class Cell:
    family: str
    case: str
    p: Side
    d: Side
    kind: str = "pull"  # pull | push | prefix

    @property
    def key(self) -> str:
        return f"{self.family}: {self.case}"


FAMILIES: dict[str, MatrixFamily] = {f.name: f for f in (
    MatrixFamily("dense", "smollm2_hf_dir", "float32", about="SmolLM2-135M fp32"),
    MatrixFamily("dense-tp", "tiny_llama_tp_dir", "float32", about="tiny Llama, 4 KV heads, fp32"),
    MatrixFamily("dense-bf16", "smollm2_hf_dir", "bfloat16", about="SmolLM2-135M bf16"),
    MatrixFamily("dense-fp8", "smollm2_hf_dir", "float32", ("--kv-cache-dtype", "fp8"),
                 "SmolLM2-135M fp32 weights, fp8 KV cache"),
    MatrixFamily("dense-vec16", "tiny_llama_head80_dir", "float32", about="tiny Llama, head size 80 (vec16)"),
    MatrixFamily("swa", "tiny_gemma3_dir", "float32", ("--max-num-batched-tokens", "128"),
                 "tiny Gemma-3-like, interleaved sliding window 64, hybrid allocator on"),
    MatrixFamily("swa-off", "tiny_gemma3_dir", "float32",
                 ("--max-num-batched-tokens", "128", "--disable-hybrid-kv-cache-manager",
                  "--no-enable-prefix-caching"), "tiny Gemma-3-like, hybrid allocator off"),
    MatrixFamily("uniform", "tiny_mistral_dir", "float32", ("--max-num-batched-tokens", "128"),
                 "tiny Mistral-like, uniform sliding window"),
    MatrixFamily("mla", "tiny_deepseek_mla_dir", "bfloat16", ("--attention-backend", "CPU_MLA"),
                 "tiny DeepSeek-V2-like MLA, bf16, CPU_MLA"),
    MatrixFamily("mla-amx", "tiny_deepseek_mla_dir", "bfloat16", ("--attention-backend", "AMX_MLA"),
                 "tiny DeepSeek-V2-like MLA, bf16, AMX_MLA (CPUs with AMX)"),
    MatrixFamily("hybrid", "tiny_granite_hybrid_dir", "float32", ("--no-enable-prefix-caching",),
                 "tiny GraniteMoeHybrid (Mamba2 + attention), fp32"),
    MatrixFamily("gdn-tp", "tiny_qwen3_next_tp_dir", "bfloat16", ("--no-enable-prefix-caching",),
                 "tiny Qwen3-Next-like (GDN + attention), bf16, 2 GDN key heads"),
    # vLLM sizes this model's block itself (640) and keeps a larger --block-size.
    MatrixFamily("gdn", "tiny_qwen3_next_dir", "bfloat16", ("--no-enable-prefix-caching",),
                 "tiny Qwen3-Next-like (GDN + attention), bf16"),
)}

_TP2, _TP1 = Side(tp=2), Side()
CELLS: tuple[Cell, ...] = (
    Cell("dense", "same block (128), D prefix hit", _TP1, _TP1, "prefix"),
    Cell("dense", "same block (128), push", _TP1, _TP1, "push"),
    Cell("dense-tp", "P TP 2 -> D TP 1", _TP2, _TP1),
    Cell("dense-tp", "P TP 1 -> D TP 2", _TP1, _TP2),
    Cell("dense-bf16", "P 32 -> D 128", Side(block=32), _TP1),
    Cell("dense-bf16", "P 128 -> D 32", _TP1, Side(block=32)),
    Cell("dense-fp8", "P 32 -> D 128", Side(block=32), _TP1),
    Cell("dense-vec16", "P 32 -> D 128 (vec16 on both)", Side(block=32), _TP1),
    Cell("swa", "same block (32), D prefix hit", Side(block=32), Side(block=32), "prefix"),
    Cell("swa-off", "P 32 -> D 64", Side(block=32), Side(block=64)),
    Cell("uniform", "same block (32)", Side(block=32), Side(block=32)),
    Cell("uniform", "P 32 -> D 64", Side(block=32), Side(block=64)),
    Cell("mla", "P TP 2 -> D TP 1", Side(tp=2, block=16), Side(block=16)),
    Cell("mla", "P TP 1 -> D TP 2", Side(block=16), Side(tp=2, block=16)),
    Cell("mla", "same block (16), push", Side(block=16), Side(block=16), "push"),
    Cell("mla-amx", "same block (32), D prefix hit", Side(block=32), Side(block=32), "prefix"),
    Cell("hybrid", "P TP 2 -> D TP 1", _TP2, _TP1),
    Cell("hybrid", "P TP 1 -> D TP 2", _TP1, _TP2),
    Cell("hybrid", "P TP 2 -> D TP 2", _TP2, _TP2),
    Cell("gdn-tp", "P TP 2 -> D TP 2", _TP2, _TP2),
    Cell("gdn-tp", "P TP 2 -> D TP 1", _TP2, _TP1),
    Cell("gdn", "P 640 -> D 1280", Side(block=640), Side(block=1280)),
    Cell("gdn", "P 1280 -> D 640", Side(block=1280), Side(block=640)),
)


@dataclass(frozen=True)
class MatrixConfig:
    cells: tuple[Cell, ...] = CELLS
    connectors: tuple[str, ...] = CONNECTORS
    max_tokens: int = 16
    deadline_s: float = 60.0  # per request: past it, the cell is a hang
    startup_timeout_s: float = 300.0
    max_servers: int = 4
    log_dir: Path = Path("bench-results/vllm-matrix/logs")
    nixl_extra: dict[str, Any] = field(default_factory=dict)


def prompts_for(cell: Cell) -> list[str]:
    """The bench's six reference prompts; for `prefix`, one long story asked three questions
    (after the first, D's prefix cache holds the story's whole blocks)."""
    if cell.kind != "prefix":
        return reference_prompts()
    story = reference_prompts()[4].rsplit("\n", 1)[0]
    return [story + q for q in ("\nWhat do the farmers bring?\nAnswer:",
                                "\nWho repaired the bells?\nAnswer:",
                                "\nName the building on the coast:\nAnswer:")]


def _cores(side: Side, role: str) -> str:
    return "0|1" if side.tp == 2 else ("0" if role == "P" else "1")


def _spec(family: MatrixFamily, side: Side, model: Path, port: int, role: str, name: str,
          kv_config: dict[str, Any] | None, env: dict[str, str]) -> VllmServerSpec:
    return VllmServerSpec(model=model, port=port, block_size=side.block, dtype=family.dtype,
                          cores=_cores(side, role), kv_transfer_config=kv_config, tensor_parallel_size=side.tp,
                          enforce_eager=True, env={**env, **dict(side.env), "PYTHONPATH": _pythonpath()},
                          args=["--seed", "0", *family.args, *side.args], name=name)


def _connector_config(connector: str, kind: str, side_port: int, secret: str,
                      nixl_extra: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    if connector == "nixl":
        cfg: dict[str, Any] = {"kv_connector": "NixlPushConnector" if kind == "push" else "NixlConnector",
                               "kv_role": "kv_both"}
        if nixl_extra:
            cfg["kv_connector_extra_config"] = dict(nixl_extra)
        return cfg, {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port)}
    return kvlink_transfer_config(side_port), {"KVLINK_SECRET": secret}


_RAISED = re.compile(r"\b[A-Za-z_.]*(Error|Exception|Interrupt)\b: .+")


def _first_error_line(service: Service) -> str:
    """The most telling line of a dead server's log: the last exception it raised (its
    message), else its last line."""
    lines = [ln.strip() for ln in service.log_tail(300).splitlines() if ln.strip()]
    raised = [ln for ln in lines if "WARNING" not in ln and _RAISED.search(ln)]
    if raised:
        match = _RAISED.search(raised[-1])
        assert match is not None
        return match.group(0)[-300:]
    return lines[-1][-300:] if lines else "(empty log)"


class ServerPool:
    """Running servers by (connector, family, role, side, kind), reused by the next cell that
    has the same ones; at most `max_servers` at once. A cell starts with only its own servers
    left running (`keep_only`): an idle NixlConnector worker keeps about half a core busy, and
    four of them starved a colocated reference's start past its timeout on two cores."""

    def __init__(self, config: MatrixConfig, secret: str, progress: Progress) -> None:
        self.config, self.secret, self.progress = config, secret, progress
        self.running: dict[tuple[Any, ...], Service] = {}
        self.failed: dict[tuple[Any, ...], str] = {}

    def get(self, connector: str, family: MatrixFamily, model: Path, cell: Cell) -> tuple[Service, Service]:
        """P and D of the cell, started together where new; raises RuntimeError(reason) when one
        would not start."""
        keys = self._keys(connector, family, cell)
        for key in keys.values():
            if key in self.failed:
                raise RuntimeError(self.failed[key])
        wanted = [(role, key) for role, key in keys.items()
                  if key not in self.running or self.running[key].proc.poll() is not None]
        for _, key in wanted:
            self.running.pop(key, None)
        while self.running and len(self.running) + len(wanted) > self.config.max_servers:
            old_key = next(k for k in self.running if k not in keys.values())
            stop_servers([self.running.pop(old_key)])
        specs = []
        for role, key in wanted:
            side = cell.p if role == "P" else cell.d
            port, side_port = launcher.free_port(), launcher.free_port(span=4)
            kv, env = _connector_config(connector, cell.kind, side_port, self.secret, self.config.nixl_extra)
            name = f"{connector}-{family.name}-{role}-tp{side.tp}-b{side.block}{'-push' if cell.kind == 'push' else ''}"
            specs.append((key, _spec(family, side, model, port, role, name, kv, env)))
        if specs:
            self.progress(f"  starting {', '.join(s.name for _, s in specs)}")
            started = [(key, start_server(spec, self.config.log_dir)) for key, spec in specs]
            try:
                wait_ready([s for _, s in started], self.config.startup_timeout_s, lambda _line: None)
            except BaseException as error:
                if not isinstance(error, (RuntimeError, TimeoutError)):  # interrupted: stop what started
                    stop_servers([s for _, s in started])
                    raise
                dead = [(key, s) for key, s in started if s.proc.poll() is not None]
                if dead:
                    reason = f"{dead[0][1].name}: {_first_error_line(dead[0][1])}"
                else:
                    dead = started
                    reason = f"not ready within {self.config.startup_timeout_s:.0f} s"
                stop_servers([s for _, s in started])
                for key, _ in dead:
                    self.failed[key] = reason
                raise RuntimeError(reason) from error
            self.running.update(dict(started))
        # Newest last, so the least recently used are stopped first.
        for key in keys.values():
            self.running[key] = self.running.pop(key)
        return self.running[keys["P"]], self.running[keys["D"]]

    @staticmethod
    def _keys(connector: str, family: MatrixFamily, cell: Cell) -> dict[str, tuple[Any, ...]]:
        return {role: (connector, family.name, role, side, cell.kind == "push")
                for role, side in (("P", cell.p), ("D", cell.d))}

    def keep_only(self, connector: str, family: MatrixFamily, cell: Cell) -> None:
        """Stop every running server that `cell` does not use."""
        keys = set(self._keys(connector, family, cell).values())
        idle = [key for key in self.running if key not in keys]
        if idle:
            stop_servers([self.running.pop(key) for key in idle])

    def stop(self) -> None:
        stop_servers(list(self.running.values()))
        self.running.clear()


def reference_answers(config: MatrixConfig, family: MatrixFamily, model: Path, side: Side,
                      prompts: list[str], progress: Progress) -> list[str | None]:
    """Colocated vLLM's greedy texts with `side`'s flags (no connector), on a server started
    for them and stopped after."""
    spec = _spec(family, side, model, launcher.free_port(), "P", f"colocated-{family.name}-tp{side.tp}-b{side.block}",
                 None, {})
    progress(f"  colocated reference: {family.name}, {side.label()}")
    server = start_server(spec, config.log_dir)
    try:
        wait_ready([server], config.startup_timeout_s, lambda _line: None)
        name = served_model(server.url)
        return [complete(server.url, name, prompt, config.max_tokens, config.deadline_s)["text"]
                for prompt in prompts]
    finally:
        stop_servers([server])


def run_pd(config: MatrixConfig, connector: str, cell: Cell, p: Service, d: Service, prompts: list[str],
           references: dict[str, list[str | None]]) -> dict[str, Any]:
    """Every prompt P -> D; each answer sorted against colocated vLLM at D's flags (and
    compared with the other references too)."""
    try:
        model = served_model(d.url)
    except httpx.HTTPError as error:  # up by /health, yet not answering: counted as a hang
        return {"answers": [], "stopped": f"hang: D did not list its model after its start ({type(error).__name__})"}
    tag = uuid.uuid4().hex[:8]
    prefix = METRIC_PREFIX[connector]
    answers: list[dict[str, Any]] = []
    stopped = ""
    for index, prompt in enumerate(prompts):
        ask: dict[str, Any] = {"do_remote_decode": True}
        if connector == "kvlink" and cell.kind == "push":
            ask["transfer_mode"] = "push"
        before = kv_bytes_total(d.url, prefix) if connector == "kvlink" or cell.kind != "push" else None
        rid = f"matrix-{tag}-{index}"
        first = complete(p.url, model, prompt, 1, config.deadline_s, ask, rid)
        answer: dict[str, Any] = {"prompt": index}
        if first["status"] != 200 or not isinstance(first.get("params"), dict):
            answer.update(outcome="hang" if first.get("timed_out") else "HTTP error",
                          detail=f"P: {first['status']} {first['error'] or 'no kv_transfer_params'}")
        else:
            got = complete(d.url, model, prompt, config.max_tokens, config.deadline_s, first["params"], rid)
            answer["text"] = got["text"]
            if got["status"] == 200:
                answer["equal"] = {name: got["text"] == ref[index] for name, ref in references.items()}
                answer["outcome"] = "exact" if answer["equal"][PRIMARY] else "wrong text"
            else:
                answer.update(outcome="hang" if got.get("timed_out") else "HTTP error",
                              detail=f"D: {got['status']} {got['error']}")
            time.sleep(0.3)  # D's stats reach its API server with its next step
            after = kv_bytes_total(d.url, prefix)
            if before is not None and after is not None:
                answer["kv_bytes"] = after - before
        answers.append(answer)
        dead = [s for s in (p, d) if s.proc.poll() is not None]
        if dead:
            stopped = f"crash: {dead[0].name} exited: {_first_error_line(dead[0])}"
            break
        if answer["outcome"] == "hang":
            stopped = f"hang past {config.deadline_s:.0f} s"
            break
    return {"answers": answers, "stopped": stopped}


def summarize(result: dict[str, Any], total: int) -> str:
    """One matrix cell: the outcome of every prompt, most severe first."""
    if result.get("start_failed"):
        return f"start failed: {result['start_failed']}"
    answers = result.get("answers") or []
    counts: dict[str, int] = {}
    for answer in answers:
        counts[answer["outcome"]] = counts.get(answer["outcome"], 0) + 1
    parts = []
    if result.get("stopped"):
        parts.append(result["stopped"])
    for outcome in ("HTTP error", "wrong text", "exact"):
        if counts.get(outcome):
            parts.append(f"{outcome} {counts[outcome]}/{total}")
    other = [a["equal"][SECONDARY] for a in answers if SECONDARY in a.get("equal", {})]
    if other:
        parts.append(f"equal to colocated at P's flags {sum(other)}/{total}")
    errors = [a["detail"] for a in answers if a.get("detail")]
    if errors:
        parts.append(f"first error: {errors[0][:160]}")
    return "; ".join(parts) or "no answers"


def _references_needed(cell: Cell) -> dict[str, Side]:
    """Colocated sides to compare against: D's flags, and P's where the TP sizes differ."""
    refs = {PRIMARY: replace(cell.d, env=())}
    if cell.p.tp != cell.d.tp:
        refs[SECONDARY] = replace(cell.p, env=())
    return refs


def run_matrix(config: MatrixConfig, progress: Progress,
               on_cell: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every cell of `config`; `on_cell(report so far)` after each (a long run keeps what it has)."""
    from kvlink.connector.secret import new_secret
    from kvlink.integrations.vllm import models

    config.log_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "cells": [],
                              "config": {"connectors": list(config.connectors), "max_tokens": config.max_tokens,
                                         "deadline_s": config.deadline_s, "nixl_extra": config.nixl_extra}}
    secret = new_secret()
    cache: dict[tuple[Any, ...], list[str | None]] = {}
    pools = {c: ServerPool(config, secret, progress) for c in config.connectors}
    try:
        for number, cell in enumerate(config.cells, 1):
            family = FAMILIES[cell.family]
            model = Path(getattr(models, family.model)())
            prompts = prompts_for(cell)
            progress(f"[{number}/{len(config.cells)}] {cell.key} ({family.about})")
            for connector, pool in pools.items():
                pool.keep_only(connector, family, cell)
            references: dict[str, list[str | None]] = {}
            try:
                for name, side in _references_needed(cell).items():
                    key = (family.name, side, cell.kind == "prefix")
                    if key not in cache:
                        cache[key] = reference_answers(config, family, model, side, prompts, progress)
                    references[name] = cache[key]
            except (RuntimeError, TimeoutError) as error:
                progress(f"  colocated reference failed: {str(error)[:300]}")
                report["cells"].append({"cell": asdict(cell), "key": cell.key, "reference_failed": str(error)[:500]})
                continue
            entry: dict[str, Any] = {"cell": asdict(cell), "key": cell.key, "references": references,
                                     "connectors": {}}
            for connector in config.connectors:
                pool = pools[connector]
                for other in pools.values():  # one connector's servers at a time
                    if other is not pool:
                        other.stop()
                try:
                    p, d = pool.get(connector, family, model, cell)
                    result = run_pd(config, connector, cell, p, d, prompts, references)
                except RuntimeError as error:
                    result = {"start_failed": str(error)}
                result["summary"] = summarize(result, len(prompts))
                moved = [a.get("kv_bytes") for a in result.get("answers") or []]
                if cell.kind == "prefix" and moved and all(m is not None for m in moved):
                    result["summary"] += "; KV bytes D loaded per question: " + ", ".join(f"{m:,.0f}" for m in moved)
                progress(f"  {connector}: {result['summary']}")
                entry["connectors"][connector] = result
                if result.get("stopped"):
                    pool.stop()  # a hung or crashed server set is not reused
            report["cells"].append(entry)
            if on_cell is not None:
                on_cell(report)
    finally:
        for pool in pools.values():
            pool.stop()
    report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    return report


def markdown(report: dict[str, Any]) -> str:
    connectors = report["config"]["connectors"]
    names = {"nixl": "NixlConnector", "kvlink": "kvlink"}
    lines = ["| family | case | " + " | ".join(names[c] for c in connectors) + " |",
             "|---|---|" + "---|" * len(connectors)]
    for entry in report["cells"]:
        family, case = entry["key"].split(": ", 1)
        if "reference_failed" in entry:
            cells = ["colocated reference failed"] * len(connectors)
        else:
            cells = [entry["connectors"].get(c, {}).get("summary", "not run") for c in connectors]
        lines.append(f"| {family} | {case} | " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines) + "\n"
