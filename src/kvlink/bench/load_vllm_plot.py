"""The memory curve of `kvlink bench load --engine vllm`: RSS of every process, the kill and restart marked."""

from __future__ import annotations

import os
import time
from pathlib import Path

from kvlink.bench.memory_series import Sample

PARTS = ("api", "engine", "worker")


def machine() -> str:
    """Date, cores, CPU model, memory and whether the CPU has AMX tiles, for the figure's title."""
    info = Path("/proc/cpuinfo").read_text(errors="replace") if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                 "unknown CPU")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    mem = next((int(line.split()[1]) / 2 ** 20 for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal:")), 0.0)
    return (f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, {len(os.sched_getaffinity(0))} cores "
            f"({model}, AMX {'yes' if 'amx_tile' in flags else 'no'}), {mem:.0f} GiB")


def plot(samples: list[Sample], marks: dict[str, float | None], load_started: float, path: Path, title: str) -> None:
    """Top: RSS per process (one colour per server, one line style per part). Bottom: the sum
    over all processes and the requests finished. Times in minutes since the load began;
    `load_started` and the events are on the monotonic clock, the samples since the sampler began
    (it began at `load_started`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = [s.t_s / 60 for s in samples]
    names = list(samples[0].rss_kib) if samples else []
    servers = sorted({n.split(" ")[0] for n in names if " " in n})
    colours = {server: f"C{k}" for k, server in enumerate(servers)}
    styles = dict(zip(PARTS, ("-", "--", ":"), strict=True))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 8), sharex=True, height_ratios=(3, 1))
    for name in names:
        server, _, part = name.partition(" ")
        top.plot(minutes, [s.rss_kib.get(name, 0) / 1024 for s in samples], label=name,
                 color=colours.get(server, "black"), linestyle=styles.get(part, "-."))
    top.set_ylabel("RSS MiB")
    top.set_title(f"{title}\n{machine()}", fontsize=10)
    top.legend(ncol=4, fontsize=7, loc="center left")
    bottom.plot(minutes, [sum(s.rss_kib.values()) / 2 ** 20 for s in samples], color="black", label="sum, GiB")
    bottom.set_ylabel("RSS GiB, sum")
    requests = bottom.twinx()
    requests.plot(minutes, [s.requests for s in samples], color="grey", linestyle="--")
    requests.set_ylabel("requests finished", color="grey")
    bottom.set_xlabel("minutes since the load began")
    # Ready and back are a second or two apart: their labels go on either side of the lines.
    for t, label, side in ((marks.get("kill_t"), "P killed", "right"), (marks.get("ready_t"), "P restarted", "right"),
                           (marks.get("back_t"), "P back in vllm-router", "left")):
        if t is None:
            continue
        for axis in (top, bottom):
            axis.axvline((t - load_started) / 60, color="red", linewidth=0.8, linestyle="--")
        top.annotate(label, ((t - load_started) / 60, top.get_ylim()[1]), rotation=90, va="top", ha=side,
                     fontsize=7, color="red")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
