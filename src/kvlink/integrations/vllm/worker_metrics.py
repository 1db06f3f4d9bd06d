"""kvlink's own counters from inside a vLLM worker: a small HTTP endpoint per rank.

vLLM's /metrics carries the per-transfer figures (`vllm:kvlink_*`); this endpoint adds what
vLLM has no place for: kvlink's cumulative counters and what the worker holds right now
(leases, loads in flight, open transfers), so operators and tests can check nothing leaks.
`GET /metrics` (Prometheus text) and `GET /debug/state` (JSON).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvlink.connector.stats import PrometheusExporter


class WorkerMetrics:
    def __init__(self, host: str, port: int, state: Callable[[], dict[str, Any]], labels: str) -> None:
        self.exporter = PrometheusExporter("kvlink")
        self._lock = threading.Lock()
        self._state = state
        self._labels = labels
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/metrics":
                    body, kind = owner.render().encode(), "text/plain; version=0.0.4"
                elif self.path == "/debug/state":
                    body, kind = json.dumps(owner.state()).encode(), "application/json"
                else:
                    self.send_error(404, "GET /metrics or /debug/state")
                    return
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, name="kvlink-metrics", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def update(self, snapshot: dict[str, Any]) -> None:
        with self._lock:
            self.exporter.update(snapshot)

    def state(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._state())

    def render(self) -> str:
        with self._lock:
            text = self.exporter.render()
            state = self._state()
        lines = [text.rstrip("\n")]
        for key, value in sorted(state.items()):
            # One family per name: the exporter already renders the worker's own gauges.
            if isinstance(value, int) and key not in self.exporter.gauges:
                lines += [f"# TYPE kvlink_{key} gauge", f"kvlink_{key}{{{self._labels}}} {value}"]
        return "\n".join(lines) + "\n"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
