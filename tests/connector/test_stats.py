"""Stats accumulate, reset per snapshot, and render as valid Prometheus text."""

from __future__ import annotations

from kvlink.connector.stats import ConnectorStats, PrometheusExporter, TransferRecord


def test_snapshot_resets_transfers_but_keeps_counters() -> None:
    s = ConnectorStats()
    s.record(TransferRecord("r", 0.002, 0.001, 4096, 3))
    s.count("stalled_transfers_total")
    snap = s.take()
    assert snap["counters"]["bytes_total"] == 4096
    assert snap["counters"]["stalled_transfers_total"] == 1
    assert len(snap["transfers"]) == 1
    assert s.take()["transfers"] == []


def test_prometheus_text_has_counters_and_cumulative_histograms() -> None:
    s = ConnectorStats()
    s.record(TransferRecord("a", 0.002, 0.001, 4096, 3))
    s.record(TransferRecord("b", 0.2, 0.001, 1 << 20, 300))
    exp = PrometheusExporter()
    exp.update(s.take())
    text = exp.render()
    assert "kvlink_transfers_total 2" in text
    assert 'kvlink_xfer_time_seconds_bucket{le="0.0025"} 1' in text
    assert 'kvlink_xfer_time_seconds_bucket{le="+Inf"} 2' in text
    assert "kvlink_num_descriptors_count 2" in text
    for line in text.splitlines():
        assert line.startswith("#") or len(line.split(" ")) == 2


def test_exporter_renders_per_engine_counters_and_gauges() -> None:
    from kvlink.connector.stats import ConnectorStats, PrometheusExporter

    stats = ConnectorStats()
    stats.count_engine("handshakes_total", "P1")
    stats.count_engine("handshakes_total", "P1")
    stats.count_engine("failed_handshakes_by_engine_total", 'odd"id')
    stats.gauges["pending_sends"] = 3
    exporter = PrometheusExporter()
    exporter.update(stats.take())
    text = exporter.render()
    assert 'kvlink_handshakes_total{remote_engine="P1"} 2' in text
    assert 'kvlink_failed_handshakes_by_engine_total{remote_engine="odd\\"id"} 1' in text
    assert "# TYPE kvlink_pending_sends gauge\nkvlink_pending_sends 3" in text
    stats.gauges["pending_sends"] = 0
    exporter.update(stats.take())
    assert "kvlink_pending_sends 0" in exporter.render()  # a gauge follows the level, down too
