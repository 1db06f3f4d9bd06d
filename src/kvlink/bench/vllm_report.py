"""The side-by-side report of `kvlink bench vllm`: table, markdown, target checks, JSON and chart.

Pure over the report dict (no vLLM, no servers), so a saved report renders again."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvlink.bench.vllm_client import CLIENT_FIGURES, clean_client

IDLE_CPU_TARGET_PCT = 2.0
TRANSFER_RATIO_TARGET = 0.5


def fmt(value: Any, digits: int = 1) -> str:
    """A figure as a table cell: "-" when missing, `digits` decimals, 3 significant when huge."""
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


def _same_as_nixl(result: dict[str, Any], results: list[dict[str, Any]]) -> str:
    """For a kvlink case: how many answers equal NixlConnector's in the same block case (where
    colocated vLLM itself computes differently, e.g. MLA on CPU, this is what compares)."""
    if result.get("connector") != "kvlink":
        return "-"
    other = next((r for r in results if r.get("connector") == "nixl" and r.get("blocks") == result.get("blocks")),
                 None)
    mine, theirs = result.get("answers") or [], (other or {}).get("answers") or []
    if not mine or len(mine) != len(theirs):
        return "-"
    equal = sum(1 for a, b in zip(mine, theirs, strict=True) if a.get("text") is not None and a.get("text") == b.get("text"))
    return f"{equal}/{len(mine)}"


def table_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and rows (one per figure) of the side-by-side table: one column per case."""
    results: list[dict[str, Any]] = report["cases"]
    header = ["figure", *(r["case"] for r in results)]
    rows: list[list[str]] = []
    for key, label, _ in CLIENT_FIGURES:
        digits = 2 if "throughput" in key and "request" in key else 1
        rows.append([label, *(fmt((r.get("client") or {}).get(key), digits) for r in results)])
    rows.append(["KV MB / transfer", *(fmt((r.get("transfer") or {}).get("kv_mb_per_transfer"), 2)
                                      for r in results)])
    rows.append(["transfer ms", *(fmt((r.get("transfer") or {}).get("transfer_ms"), 2)
                                 for r in results)])
    rows.append(["transfers / failures", *(
        "-" if not r.get("transfer") else
        f"{r['transfer']['transfers']:.0f} / {r['transfer']['failures']:.0f}" for r in results)])
    for role in ("P", "D"):
        rows.append([f"idle CPU {role} worker %", *(fmt(((r.get("idle_cpu") or {}).get(role) or {})
                                                        .get("worker_pct"), 2) for r in results)])
        rows.append([f"idle CPU {role} API %", *(fmt(((r.get("idle_cpu") or {}).get(role) or {})
                                                     .get("api_pct"), 2) for r in results)])
    rows.append(["answers = colocated", *(answers_cell(r) for r in results)])
    same = [_same_as_nixl(r, results) for r in results]
    if any(cell != "-" for cell in same):
        rows.append(["answers = nixl's (same blocks)", *same])
    errors = [str(r["error"])[:60] if r.get("error") else "" for r in results]
    if any(errors):
        rows.append(["error", *errors])
    return header, rows


def kv_bytes_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """KV bytes D took per reference prompt (from the connector's bytes counter on D), by
    prompt length: what each connector moves for a prompt of that many tokens."""
    results: list[dict[str, Any]] = report["cases"]
    header = ["reference prompt (tokens)", *(r["case"] for r in results)]
    count = max((len(r.get("answers") or []) for r in results), default=0)
    rows = []
    for i in range(count):
        answers = [(r.get("answers") or [])[i] if i < len(r.get("answers") or []) else {} for r in results]
        tokens = next((a.get("prompt_tokens") for a in answers if a.get("prompt_tokens")), None)
        rows.append([f"#{i + 1} ({fmt(tokens)})", *(
            "-" if a.get("kv_bytes") is None else f"{a['kv_bytes'] / 1e3:.1f} kB" for a in answers)])
    return header, rows


def render_table(report: dict[str, Any]) -> str:
    header, rows = table_rows(report)
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                         enumerate(zip(cells, widths, strict=True)))

    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def _markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    return out + ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in rows]


def render_markdown(report: dict[str, Any]) -> str:
    out = _markdown_table(*table_rows(report))
    cfg = report.get("config", {})
    kv_header, kv_rows = kv_bytes_rows(report)
    if any(cell != "-" for row in kv_rows for cell in row[1:]):
        out += ["", "KV bytes D took per reference prompt:", "", *_markdown_table(kv_header, kv_rows)]
    out.append("")
    out.append(f"vLLM {report.get('vllm_version', '?')}, family {cfg.get('family', 'dense')}, "
               f"model {Path(str(cfg.get('model_dir', '?'))).name} ({cfg.get('dtype', 'float32')}"
               f"{', ' + ' '.join(cfg['server_args']) if cfg.get('server_args') else ''}), "
               f"{cfg.get('num_prompts')} prompts of {cfg.get('input_len')} tokens in / "
               f"{cfg.get('output_len')} out, concurrency {cfg.get('concurrency')}, seed "
               f"{cfg.get('seed')}{', --enforce-eager' if cfg.get('enforce_eager') else ''}; P core {cfg.get('cores', ['?'])[0]}, D core "
               f"{cfg.get('cores', ['?', '?'])[1]}; idle CPU sampled over {cfg.get('idle_s')} s.")
    if cfg.get("nixl_extra") or cfg.get("nixl_env"):
        out.append(f"NixlConnector{' [' + cfg['nixl_label'] + ']' if cfg.get('nixl_label') else ''}: "
                   f"kv_connector_extra_config {json.dumps(cfg.get('nixl_extra') or {}, sort_keys=True)}, "
                   f"environment {json.dumps(cfg.get('nixl_env') or {}, sort_keys=True)}.")
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
                               "ok": ok, "detail": f"kvlink {fmt(a, 2)} vs nixl {fmt(b, 2)}"})
            a, b = (kv.get("transfer") or {}).get("transfer_ms"), (nx.get("transfer") or {}).get("transfer_ms")
            ok = None if a is None or b is None else a <= TRANSFER_RATIO_TARGET * b
            checks.append({"target": f"{blocks} kvlink transfer ms <= {TRANSFER_RATIO_TARGET}x nixl",
                           "ok": ok, "detail": f"kvlink {fmt(a, 2)} vs nixl {fmt(b, 2)}"
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
                           "detail": f"worst {fmt(worst, 2)} %"})
    return checks


def refresh(report: dict[str, Any]) -> dict[str, Any]:
    """A saved report with its client figures cleaned and its targets checked again."""
    for result in report["cases"]:
        if result.get("client"):
            result["client"] = clean_client(result["client"])
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
    fig.suptitle(f"1P1D in vLLM ({report.get('vllm_version')}, {cfg.get('family', 'dense')}): "
                 f"KvlinkConnector vs NixlConnector — "
                 f"{cfg['num_prompts']} prompts, {cfg['input_len']} in / {cfg['output_len']} out, "
                 f"concurrency {cfg['concurrency']}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
