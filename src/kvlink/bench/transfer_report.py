"""Progress lines, table, target verdicts and chart for `kvlink bench transfer` results."""

from __future__ import annotations

from typing import Any

CPU_TARGET_TOKENS = 4096
VERIFY_TARGETS = {"sample": 1.05, "full": 1.5}
"""The KV check's targets: a load's time with the mode over its time with `off`, at most."""


def _base_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of the first verify-kv mode (every row when the run had one)."""
    modes = result.get("verify_modes") or []
    return [r for r in result["rows"] if not modes or r.get("verify_kv", modes[0]) == modes[0]]


def _mode_label(row: dict[str, Any]) -> str:
    if "time_vs_base" not in row:
        return ""
    spread = row["time_vs_base_all"]
    return f"{row['time_vs_base']:.3f} ({min(spread):.2f}–{max(spread):.2f})"


def progress_line(row: dict[str, Any]) -> str:
    """One size and layout's row as the bench prints it while running."""
    return (f"  {row['tokens']:>6} tokens {row['layout']:<10} {row['nbytes'] / 2**20:8.1f} MiB  "
            f"connector {row['wall_s'] * 1e3:8.2f} ms {row['gbps']:6.2f} GB/s  "
            f"raw NIXL {row['raw_s'] * 1e3:8.2f} ms ({row['raw_descriptors']} x {row['raw_desc_bytes'] // 1024} KiB)  "
            f"x{row['ratio_vs_raw']:.2f}"
            + (f" (same descriptors x{row['ratio_vs_same']:.2f})" if "ratio_vs_same" in row else "")
            + f"  cpu {row['connector_cpu_s'] * 1e3:.2f} ms ({row['cpu_pct']:.1f}%)"
            + (f"  verify-kv {row['verify_kv']}" if "verify_kv" in row else "")
            + (f" time x{row['time_vs_base']:.3f} of the first mode's" if "time_vs_base" in row else ""))


def table(result: dict[str, Any]) -> str:
    head = ("| tokens | layout | MiB | descriptors (rank 0) | connector ms | connector GB/s | "
            "raw NIXL ms | raw GB/s | raw descriptors | connector / raw (per-round median, range) | "
            f"connector / NIXL with its own descriptors | {result.get('memcpy_label', 'numpy memcpy')} GB/s | "
            "connector CPU ms (plan / post) | CPU % of transfer | verify-kv | "
            f"time / {(result.get('verify_modes') or ['?'])[0]}'s (per-round median, range) |")
    lines = [head, "|---:|:---|" + "---:|" * 12 + ":---|---:|"]
    for r in result["rows"]:
        same = (f"{r['ratio_vs_same']:.2f}" if "ratio_vs_same" in r else "n/a (push)")
        spread = r.get("ratio_vs_raw_all") or [r["ratio_vs_raw"]]
        lines.append(
            f"| {r['tokens']:,} | {r['layout']} | {r['nbytes'] / 2**20:.1f} | {r['rank0_descriptors']:,} | "
            f"{r['wall_s'] * 1e3:.2f} | {r['gbps']:.2f} | {r['raw_s'] * 1e3:.2f} | {r['raw_gbps']:.2f} | "
            f"{r['raw_descriptors']:,} x {r['raw_desc_bytes'] // 1024} KiB | {r['ratio_vs_raw']:.2f} "
            f"({min(spread):.2f}–{max(spread):.2f}) | {same} | "
            f"{r['memcpy_gbps']:.2f} | {r['connector_cpu_s'] * 1e3:.3f} ({r['plan_cpu_s'] * 1e3:.3f} / "
            f"{r['post_cpu_s'] * 1e3:.3f}) | {r['cpu_pct']:.2f} | {r.get('verify_kv', '')} | {_mode_label(r)} |")
    return "\n".join(lines)


def verdicts(result: dict[str, Any]) -> list[str]:
    out = []
    base = _base_rows(result)
    for layout, what in (("contiguous", "raw NIXL, one descriptor"),
                         ("fragmented", "raw NIXL, same descriptor sizes")):
        rows = [r for r in base if r["layout"] == layout]
        worst = min(rows, key=lambda r: r["ratio_vs_raw"])
        met = all(r["ratio_vs_raw"] >= 0.9 for r in rows)
        ratios = ", ".join(f"{r['tokens']}: {r['ratio_vs_raw']:.2f}" for r in rows)
        out.append(f"{layout} connector >= 0.9x {what}: {'MET' if met else 'NOT MET'} "
                   f"(median of per-round ratios {ratios}; worst {worst['ratio_vs_raw']:.2f} at "
                   f"{worst['tokens']} tokens)")
    cpu_rows = [r for r in base if r["tokens"] == CPU_TARGET_TOKENS]
    if cpu_rows:
        pcts = ", ".join(f"{r['layout']} {r['cpu_pct']:.2f}%" for r in cpu_rows)
        met = all(r["cpu_pct"] < 5 for r in cpu_rows)
        out.append(f"connector CPU per request < 5% of transfer time at {CPU_TARGET_TOKENS} tokens: "
                   f"{'MET' if met else 'NOT MET'} ({pcts})")
    else:
        out.append(f"CPU target not evaluated: {CPU_TARGET_TOKENS} tokens not in --tokens")
    modes = result.get("verify_modes") or []
    for mode, target in VERIFY_TARGETS.items():
        rows = [r for r in result["rows"] if r.get("verify_kv") == mode and "time_vs_base" in r]
        if not rows or modes[0] != "off":
            continue
        met = all(r["time_vs_base"] <= target for r in rows)
        worst = max(rows, key=lambda r: r["time_vs_base"])
        costs = ", ".join(f"{r['tokens']} {r['layout']}: {r['time_vs_base']:.3f}" for r in rows)
        out.append(f"verify-kv {mode} load time <= {target:g}x off's: {'MET' if met else 'NOT MET'} "
                   f"(median of per-round ratios {costs}; worst {worst['time_vs_base']:.3f} at "
                   f"{worst['tokens']} tokens {worst['layout']})")
    return out


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    tokens = sorted({r["tokens"] for r in result["rows"]})
    modes = result.get("verify_modes") or []
    raw_label = {"contiguous": "raw NIXL, one descriptor", "fragmented": "raw NIXL, same-size descriptors"}
    for layout, style in (("contiguous", "-"), ("fragmented", "--")):
        rows = sorted((r for r in _base_rows(result) if r["layout"] == layout), key=lambda r: r["tokens"])
        ax.plot([r["tokens"] for r in rows], [r["rank0_gbps"] for r in rows], "o" + style,
                label=f"connector, {layout}" + (f", verify-kv {modes[0]}" if len(modes) > 1 else ""))
        ax.plot([r["tokens"] for r in rows], [r["raw_gbps"] for r in rows], "s" + style, alpha=0.6,
                label=f"{raw_label[layout]} ({layout} ids)")
        own = [r for r in rows if "same_s" in r]
        if own:
            ax.plot([r["tokens"] for r in own], [r["rank0_nbytes"] / r["same_s"] / 1e9 for r in own],
                    "^" + style, alpha=0.6, label=f"NIXL over the connector's descriptors ({layout} ids)")
        for mode in modes[1:]:
            more = sorted((r for r in result["rows"] if r["layout"] == layout and r.get("verify_kv") == mode),
                          key=lambda r: r["tokens"])
            ax.plot([r["tokens"] for r in more], [r["rank0_gbps"] for r in more], "x" + style,
                    label=f"connector, {layout}, verify-kv {mode}")
    ax.plot(tokens, [result["memcpy"][t]["gbps"] if t in result["memcpy"] else result["memcpy"][str(t)]["gbps"]
                     for t in tokens], "k:", label=f"{result.get('memcpy_label', 'numpy memcpy')} (one process)")
    o, s = result["options"], result["sizes"]
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per request")
    ax.set_ylabel("GB/s (D rank 0)")
    ax.set_title(f"{o['preset']} ({s['layers']} layers) TP {o['p_tp']}->{o['d_tp']} {o['mode']}, "
                 f"UCX {result.get('ucx_tls') or 'default'}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
