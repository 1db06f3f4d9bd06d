"""Figures of `kvlink bench transfer`: one load's numbers from D's replies, a size's medians,
and per-round ratios against a baseline."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

# D's meters of the NIXL calls that can move bytes: `transfer` (the whole copy on the CMA
# path), `check_xfer_state` and `get_new_notifs` (each drives UCX's progress: over TCP, the copy).
NIXL_METERS = ("transfer", "check", "progress")


def nixl_figure(reply: dict[str, Any], key: str) -> float:
    """`cpu_s` or `wall_s` D's rank spent inside NIXL's copy-moving calls for one load."""
    return float(sum(reply["meters"][name][key] for name in NIXL_METERS))


def connector_cpu_s(reply: dict[str, Any]) -> float:
    """The connector's CPU for one load on one D rank: `start_load_kv` and the
    `get_finished()` that reported the request, each already less the NIXL calls inside it.

    NIXL's CPU in the other polls is not taken off: those polls are not counted either
    (over TCP it is most of the copy, and taking it off made the figure negative)."""
    return float(reply["start_cpu_s"] + reply["last_poll_cpu_s"])


def load_figures(replies: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One request's figures from every D rank's `load_timed` reply: bytes summed over the
    ranks, times and CPU of the slowest rank."""
    meters = [r["meters"] for r in replies]
    return {
        "wall_s": max(r["wall_s"] for r in replies), "nbytes": sum(r["nbytes"] for r in replies),
        "rank0_nbytes": replies[0]["nbytes"], "rank0_descriptors": replies[0]["descriptors"],
        "descriptors": sum(r["descriptors"] for r in replies),
        "plan_cpu_s": max(m["plan"]["cpu_s"] for m in meters),
        # NIXL's `transfer` only runs inside `NixlAgent.post`: what is left is the connector's
        "post_cpu_s": max(m["post"]["cpu_s"] - m["transfer"]["cpu_s"] for m in meters),
        "nixl_cpu_s": max(nixl_figure(r, "cpu_s") for r in replies),
        "nixl_wall_s": max(nixl_figure(r, "wall_s") for r in replies),
        "connector_cpu_s": max(connector_cpu_s(r) for r in replies),
        "polls": max(r["polls"] for r in replies),
        "post_wall_s": max(r["post_wall_s"] for r in replies),
    }


def summarize(tokens: int, layout: str, samples: list[dict[str, Any]], memcpy: dict[str, float]) -> dict[str, Any]:
    """A size and layout's row: the median of each figure over the connector's rounds."""
    med: Callable[[str], float] = lambda key: statistics.median(float(s[key]) for s in samples)  # noqa: E731
    wall = med("wall_s")
    nbytes = samples[0]["nbytes"]
    return {
        "tokens": tokens, "layout": layout, "nbytes": nbytes, "rank0_nbytes": samples[0]["rank0_nbytes"],
        "rank0_descriptors": samples[0]["rank0_descriptors"], "descriptors": samples[0]["descriptors"],
        "wall_s": wall, "gbps": nbytes / wall / 1e9, "rank0_gbps": samples[0]["rank0_nbytes"] / wall / 1e9,
        "plan_cpu_s": med("plan_cpu_s"), "post_cpu_s": med("post_cpu_s"), "nixl_cpu_s": med("nixl_cpu_s"),
        "nixl_wall_s": med("nixl_wall_s"), "connector_cpu_s": med("connector_cpu_s"),
        "cpu_pct": 100 * med("connector_cpu_s") / wall, "post_wall_s": med("post_wall_s"),
        "polls": med("polls"), "polls_all": [s["polls"] for s in samples],
        "memcpy_s": memcpy["s"], "memcpy_gbps": memcpy["gbps"], "repeats": len(samples),
        "wall_all_s": [s["wall_s"] for s in samples],
    }


def ratios(key: str, baseline_s: list[float], connector_s: list[float]) -> dict[str, Any]:
    """Connector throughput over a baseline's, per round (time ratio) and their median."""
    per_round = [b / c for b, c in zip(baseline_s, connector_s, strict=True)]
    return {key: statistics.median(per_round), f"{key}_all": per_round,
            f"{key}_of_medians": statistics.median(baseline_s) / statistics.median(connector_s)}
