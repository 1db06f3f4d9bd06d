"""Transfer statistics: per-transfer figures, failure counters, Prometheus exposition."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# Remote engines with a label of their own in the per-engine counters; the rest share one.
MAX_LABELLED_ENGINES = 64
OTHER_ENGINES = "__other__"


@dataclass
class TransferRecord:
    request_id: str
    duration_s: float
    post_s: float
    nbytes: int
    descriptors: int


@dataclass
class ConnectorStats:
    """Accumulates figures; `take()` returns a plain dict and resets the per-transfer list."""

    transfers: list[TransferRecord] = field(default_factory=list)
    counters: dict[str, int] = field(
        default_factory=lambda: {
            "transfers_total": 0,
            "bytes_total": 0,
            "failed_transfers_total": 0,
            "stalled_transfers_total": 0,
            "failed_handshakes_total": 0,
            "failed_notifications_total": 0,
            "expired_leases_total": 0,
            "refused_peers_total": 0,
            "notify_only_total": 0,
            "bad_notifications_total": 0,
            "unauthenticated_notifications_total": 0,
            "rejected_handshakes_total": 0,
            "unauthenticated_handshakes_total": 0,
            # KV integrity (kvlink.connector.verifier, sealer): at 0 from the start, so an alert
            # on their increase sees the first mismatch.
            "kv_checksum_mismatch_total": 0,
            "kv_unsealed_loads_total": 0,
            "kv_unchecked_loads_total": 0,
            "kv_verified_units_total": 0,
            "kv_verified_bytes_total": 0,
            "kv_sealed_bytes_total": 0,
            "kv_early_seals_total": 0,
            "kv_unverifiable_units_total": 0,
            "kv_digest_rereads_total": 0,
            "kv_verify_us_total": 0,
        }
    )

    # (counter, remote engine id) -> count: handshakes and their failures per peer engine
    engine_counters: dict[tuple[str, str], int] = field(default_factory=dict)
    # Levels right now, set by the worker at each `get_stats` (e.g. requests P holds for D).
    gauges: dict[str, float] = field(default_factory=dict)
    _engines: set[str] = field(default_factory=set)  # the remote engines with a label of their own

    def count_engine(self, name: str, engine_id: str, n: int = 1) -> None:
        """Count under a remote engine's label; past `MAX_LABELLED_ENGINES` distinct engines
        (a client naming made-up engines) further ones count under `OTHER_ENGINES`."""
        if engine_id not in self._engines:
            if len(self._engines) >= MAX_LABELLED_ENGINES:
                engine_id = OTHER_ENGINES
            else:
                self._engines.add(engine_id)
        self.engine_counters[(name, engine_id)] = self.engine_counters.get((name, engine_id), 0) + n

    def record(self, rec: TransferRecord) -> None:
        self.transfers.append(rec)
        self.counters["transfers_total"] += 1
        self.counters["bytes_total"] += rec.nbytes

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def take(self) -> dict[str, Any]:
        out = {
            "counters": dict(self.counters),
            "transfers": [vars(t).copy() for t in self.transfers],
            "engine_counters": [[name, engine, n] for (name, engine), n in sorted(self.engine_counters.items())],
            "gauges": dict(self.gauges),
        }
        self.transfers = []
        return out


@dataclass
class _Histogram:
    buckets: tuple[float, ...]
    counts: list[int]
    total: float = 0.0
    n: int = 0

    def observe(self, value: float) -> None:
        self.n += 1
        self.total += value
        for i, edge in enumerate(self.buckets):
            if value <= edge:
                self.counts[i] += 1


class PrometheusExporter:
    """Folds `ConnectorStats.take()` snapshots into cumulative Prometheus text."""

    def __init__(self, prefix: str = "kvlink") -> None:
        self.prefix = prefix
        self.counters: dict[str, int] = {}
        self.engine_counters: dict[tuple[str, str], int] = {}
        self.gauges: dict[str, float] = {}
        byte_buckets = tuple(float(1 << k) for k in range(12, 34, 2))
        self.hist = {
            "xfer_time_seconds": _Histogram(_BUCKETS_S, [0] * len(_BUCKETS_S)),
            "post_time_seconds": _Histogram(_BUCKETS_S, [0] * len(_BUCKETS_S)),
            "bytes_transferred": _Histogram(byte_buckets, [0] * len(byte_buckets)),
            "num_descriptors": _Histogram(
                tuple(float(10**k) for k in range(7)), [0] * 7
            ),
        }

    def update(self, snapshot: dict[str, Any]) -> None:
        self.counters.update(snapshot.get("counters", {}))
        for name, engine, n in snapshot.get("engine_counters", []):
            self.engine_counters[(str(name), str(engine))] = int(n)
        self.gauges.update(snapshot.get("gauges", {}))
        for t in snapshot.get("transfers", []):
            self.hist["xfer_time_seconds"].observe(float(t["duration_s"]))
            self.hist["post_time_seconds"].observe(float(t["post_s"]))
            self.hist["bytes_transferred"].observe(float(t["nbytes"]))
            self.hist["num_descriptors"].observe(float(t["descriptors"]))

    def render(self) -> str:
        lines: list[str] = []
        for name, value in sorted(self.counters.items()):
            full = f"{self.prefix}_{name}"
            lines += [f"# TYPE {full} counter", f"{full} {value}"]
        by_name: dict[str, list[tuple[str, int]]] = {}
        for (name, engine), value in sorted(self.engine_counters.items()):
            by_name.setdefault(name, []).append((engine, value))
        for name, rows in by_name.items():
            full = f"{self.prefix}_{name}"
            lines.append(f"# TYPE {full} counter")
            lines += [f'{full}{{remote_engine="{prom_label(engine)}"}} {value}' for engine, value in rows]
        for name, gauge in sorted(self.gauges.items()):
            full = f"{self.prefix}_{name}"
            lines += [f"# TYPE {full} gauge", f"{full} {prom_number(gauge)}"]
        for name, h in self.hist.items():
            full = f"{self.prefix}_{name}"
            lines.append(f"# TYPE {full} histogram")
            for edge, c in zip(h.buckets, h.counts, strict=True):
                lines.append(f'{full}_bucket{{le="{prom_number(edge)}"}} {c}')
            lines += [f'{full}_bucket{{le="+Inf"}} {h.n}', f"{full}_sum {prom_number(h.total)}", f"{full}_count {h.n}"]
        return "\n".join(lines) + "\n"


def prom_number(value: float) -> str:
    """A sample value or bucket bound in Prometheus text: exact for whole numbers (byte
    counts pass 1e6 quickly, where `:g` would round them), else Python's shortest repr."""
    if float(value).is_integer():
        return str(int(value))
    return repr(float(value))


def prom_label(value: str) -> str:
    """A Prometheus label value: backslashes, quotes and newlines escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
