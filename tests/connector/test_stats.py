"""Stats accumulate, reset per snapshot, and render as valid Prometheus text."""

from __future__ import annotations

from kvlink.connector.stats import ConnectorStats, PrometheusExporter, TransferRecord


def rendered(stats: ConnectorStats, exporter: PrometheusExporter | None = None) -> str:
    """The Prometheus text after `exporter` (a fresh one by default) takes `stats`' snapshot."""
    exporter = exporter or PrometheusExporter()
    exporter.update(stats.take())
    return exporter.render()


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
    text = rendered(s)
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
    text = rendered(stats, exporter)
    assert 'kvlink_handshakes_total{remote_engine="P1"} 2' in text
    assert 'kvlink_failed_handshakes_by_engine_total{remote_engine="odd\\"id"} 1' in text
    assert "# TYPE kvlink_pending_sends gauge\nkvlink_pending_sends 3" in text
    stats.gauges["pending_sends"] = 0
    assert "kvlink_pending_sends 0" in rendered(stats, exporter)  # a gauge follows the level, down too


def test_prometheus_numbers_are_exact_and_parse() -> None:
    """Byte sums and bucket bounds past 1e6 print whole (`:g` rounded 81838080 to 8.18381e+07
    and the 1 MiB bound to 1.04858e+06); the text parses as Prometheus exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    s = ConnectorStats()
    s.record(TransferRecord("a", 0.002, 0.001, 81_838_080, 3))
    s.gauges["pending_send_blocks"] = 12_345_678
    text = rendered(s)
    assert "kvlink_bytes_transferred_sum 81838080" in text
    assert 'kvlink_bytes_transferred_bucket{le="1048576"} 0' in text
    assert "kvlink_pending_send_blocks 12345678" in text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    (total,) = [x for x in families["kvlink_bytes_transferred"].samples if x.name.endswith("_sum")]
    assert total.value == 81_838_080


def test_per_engine_labels_are_bounded() -> None:
    """A client naming made-up engines cannot grow the metrics without bound: past
    `MAX_LABELLED_ENGINES` distinct engines the rest count under `other`."""
    from kvlink.connector.stats import MAX_LABELLED_ENGINES, OTHER_ENGINES

    stats = ConnectorStats()
    for i in range(MAX_LABELLED_ENGINES + 50):
        stats.count_engine("failed_handshakes_by_engine_total", f"E{i}")
    stats.count_engine("handshakes_total", "E0")  # an engine already labelled keeps its label
    rows = stats.take()["engine_counters"]
    engines = {engine for _, engine, _ in rows}
    assert len(engines) == MAX_LABELLED_ENGINES + 1 and OTHER_ENGINES in engines
    assert ["failed_handshakes_by_engine_total", OTHER_ENGINES, 50] in rows
    assert ["handshakes_total", "E0", 1] in rows
