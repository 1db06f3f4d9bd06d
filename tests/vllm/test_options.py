"""The vLLM extra config → ConnectorConfig mapping, and the checks on vLLM's tensors (no engine)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvlink.integrations.vllm.layout import (
    LayerTensor,
    UnsupportedVllmLayout,
    check_layer_tensors,
    layer_index,
    order_layers,
    page_order_for,
)
from kvlink.integrations.vllm.options import (
    BadExtraConfig,
    connector_config,
    known_keys,
    with_start_incarnation,
)

SECRET = "s" * 40


def test_fields_map_by_connector_config_names() -> None:
    cfg = connector_config({"side_channel_host": "127.0.0.2", "side_channel_port": 6000, "lease_s": 12,
                            "stall_timeout_s": 3, "transfer_mode": "push", "secret": SECRET},
                           engine_id="e1", load_failure_policy="recompute")
    assert (cfg.engine_id, cfg.side_channel_host, cfg.side_channel_port) == ("e1", "127.0.0.2", 6000)
    assert (cfg.lease_s, cfg.stall_timeout_s, cfg.transfer_mode) == (12.0, 3.0, "push")
    assert cfg.load_failure_policy == "recompute" and cfg.secret == SECRET.encode()


def test_unknown_keys_are_refused_with_the_known_ones() -> None:
    with pytest.raises(BadExtraConfig) as err:
        connector_config({"side_chanel_port": 1}, engine_id="e", load_failure_policy="fail")
    message = str(err.value)
    assert "side_chanel_port" in message
    for key in ("side_channel_port", "lease_s", "stall_timeout_s", "transfer_mode", "secret"):
        assert key in message and key in known_keys()
    assert "engine_id" not in known_keys()  # vLLM's own engine id is used


@pytest.mark.parametrize("extra", [
    {"lease_s": -1}, {"lease_s": 10**9}, {"side_channel_port": 70000}, {"side_channel_port": 0},
    {"transfer_mode": "sideways"}, {"secret": ""}, {"secret": 5}, {"lease_s": "long"},
    # a string is not a boolean: "false" read as true turned signing off
    {"insecure_unsigned_params": "false"}, {"separate_notifier": "no"}, {"separate_notifier": 0},
    {"incarnation": 5}, {"incarnation": ""}, {"incarnation": "my-start"}, {"incarnation": "x" * 65}, {"secret": "abc"}, {"secret": " " + "x" * 15 + " "},
    {"transfer_mode": "layerwise"},
])
def test_bad_values_are_refused(extra: dict[str, object]) -> None:
    with pytest.raises(BadExtraConfig, match="kvlink"):
        connector_config(extra, engine_id="e", load_failure_policy="fail")


def test_a_short_secret_from_the_environment_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvlink.connector.scheduler import NixlScheduler
    from kvlink.connector.secret import MissingSecret

    monkeypatch.setenv("KVLINK_SECRET", "abc")
    config = connector_config({}, engine_id="e", load_failure_policy="fail")
    with pytest.raises(MissingSecret, match="3 bytes; it must be at least 16"):
        NixlScheduler(config, tp_size=1)
    monkeypatch.setenv("KVLINK_SECRET", "x" * 16)
    NixlScheduler(config, tp_size=1)


def test_insecure_mode_is_logged(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("KVLINK_SECRET", raising=False)
    connector_config({"insecure_unsigned_params": True}, engine_id="e", load_failure_policy="fail")
    assert "NOT signed" in caplog.text


def test_kv_integrity_options() -> None:
    default = connector_config({}, engine_id="e", load_failure_policy="fail")
    assert (default.verify_kv, default.verify_sample_units) == ("sample", 4)
    for mode in ("off", "sample", "full"):
        assert connector_config({"verify_kv": mode}, engine_id="e", load_failure_policy="fail").verify_kv == mode
    cfg = connector_config({"verify_kv": "sample", "verify_sample_units": 16}, engine_id="e",
                           load_failure_policy="fail")
    assert cfg.verify_sample_units == 16
    assert {"verify_kv", "verify_sample_units"} <= set(known_keys())


@pytest.mark.parametrize("extra, option", [
    ({"verify_kv": "fulll"}, "verify_kv"), ({"verify_kv": True}, "verify_kv"), ({"verify_kv": None}, "verify_kv"),
    ({"verify_sample_units": 0}, "verify_sample_units"), ({"verify_sample_units": "4"}, "verify_sample_units"),
    ({"verify_sample_units": 2.5}, "verify_sample_units"), ({"verify_sample_units": True}, "verify_sample_units"),
])
def test_bad_integrity_values_name_the_option(extra: dict[str, object], option: str) -> None:
    with pytest.raises(BadExtraConfig, match=f"kvlink: bad kv_connector_extra_config: {option}"):
        connector_config(extra, engine_id="e", load_failure_policy="fail")


def test_secret_file(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    cfg = connector_config({"secret_file": str(path)}, engine_id="e", load_failure_policy="fail")
    assert cfg.secret == SECRET.encode()
    with pytest.raises(BadExtraConfig, match="not both"):
        connector_config({"secret_file": str(path), "secret": SECRET}, engine_id="e", load_failure_policy="fail")
    with pytest.raises(BadExtraConfig, match="cannot read"):
        connector_config({"secret_file": str(tmp_path / "missing")}, engine_id="e", load_failure_policy="fail")


def _tensor(name: str, ptr: int, shape: tuple[int, ...] = (10, 3, 32, 128), dtype: str = "float32") -> LayerTensor:
    strides = (shape[1] * shape[2] * shape[3], shape[2] * shape[3], shape[3], 1)
    return LayerTensor(name, ptr, shape, strides, 4 if dtype == "float32" else 2, dtype)


def test_layers_are_ordered_by_index_and_shared_kv_is_registered_once() -> None:
    names = ["model.layers.10.self_attn.attn", "model.layers.2.self_attn.attn", "model.layers.3.self_attn.attn"]
    tensors = [_tensor(n, 1000 * layer_index(n)) for n in names]
    tensors.append(_tensor("model.layers.11.self_attn.attn", 10000))  # shares layer 10's memory
    ordered = order_layers(tensors)
    assert [t.name for t in ordered] == [names[1], names[2], names[0]]
    bases, sizes, blocks = check_layer_tensors(ordered, num_kv_heads=3, block_size=32, head_dim=64, dtype="float32")
    assert bases == [2000, 3000, 10000] and blocks == 10 and sizes == [10 * 3 * 32 * 128 * 4] * 3


@pytest.mark.parametrize("tensor, what", [
    (_tensor("model.layers.0.a", 0, (10, 3, 64, 128)), "expected"),
    (_tensor("model.layers.0.a", 0, dtype="bfloat16"), "dtype"),
    (LayerTensor("model.layers.0.a", 0, (10, 3, 32, 128), (1, 1, 1, 1), 4, "float32"), "contiguous"),
    (LayerTensor("model.layers.0.a", 0, (10, 3, 32), (96, 32, 1), 4, "float32"), "expected"),
])
def test_views_kvlink_would_misread_are_refused(tensor: LayerTensor, what: str) -> None:
    with pytest.raises(UnsupportedVllmLayout, match=what) as err:
        check_layer_tensors([tensor], num_kv_heads=3, block_size=32, head_dim=64, dtype="float32")
    assert "shape" in str(err.value)  # says what was seen


def test_unknown_isa_is_refused_naming_it() -> None:
    assert page_order_for("vec", "float32", 128, 64) == "vllm_cpu_vec"
    assert page_order_for("amx", "bfloat16", 128, 64) == "vllm_cpu_amx"
    with pytest.raises(UnsupportedVllmLayout, match="'neon'"):
        page_order_for("neon", "float32", 128, 64)
    with pytest.raises(UnsupportedVllmLayout, match="layer index"):
        layer_index("lm_head")


def test_agent_settings_default_to_no_progress_thread() -> None:
    from kvlink.integrations.vllm.options import agent_config, metrics_port

    default = agent_config({})
    assert not default.progress_thread and default.progress_delay_us == 10_000
    on = agent_config({"nixl_progress_thread": True, "nixl_progress_delay_us": 500})
    assert on.progress_thread and on.progress_delay_us == 500
    assert metrics_port({}) is None and metrics_port({"metrics_port": 7000}) == 7000
    for bad in ({"nixl_progress_thread": "yes"}, {"nixl_progress_delay_us": 0}, {"metrics_port": 0},
                {"metrics_port": "80"}):
        with pytest.raises(BadExtraConfig):
            connector_config(bad, engine_id="e", load_failure_policy="fail")
    # They are integration keys, not ConnectorConfig fields, yet accepted next to them.
    cfg = connector_config({"nixl_progress_delay_us": 500, "metrics_port": 7000, "lease_s": 5},
                           engine_id="e", load_failure_policy="fail")
    assert cfg.lease_s == 5.0


def test_queue_busy_poll_defaults_to_two_ms_and_is_checked() -> None:
    from kvlink.integrations.vllm.options import queue_busy_poll_s

    assert queue_busy_poll_s({}) == 0.002
    assert queue_busy_poll_s({"vllm_queue_busy_poll_ms": 0}) == 0.0
    assert queue_busy_poll_s({"vllm_queue_busy_poll_ms": None}) is None  # vLLM's own 1 s
    for bad in (-1, 1001, "2", True):
        with pytest.raises(BadExtraConfig, match="vllm_queue_busy_poll_ms"):
            queue_busy_poll_s({"vllm_queue_busy_poll_ms": bad})
    with pytest.raises(BadExtraConfig, match="vllm_queue_busy_poll_ms"):
        connector_config({"vllm_queue_busy_poll_ms": "fast"}, engine_id="e", load_failure_policy="fail")
    connector_config({"vllm_queue_busy_poll_ms": 5}, engine_id="e", load_failure_policy="fail")


def test_stuck_step_dump_defaults_to_a_minute_and_is_checked() -> None:
    from kvlink.integrations.vllm.options import stuck_step_dump_s

    assert stuck_step_dump_s({}) == 60.0
    assert stuck_step_dump_s({"stuck_step_dump_s": 2}) == 2.0
    assert stuck_step_dump_s({"stuck_step_dump_s": None}) is None  # no dumps
    for bad in (0, -1, 86401, "60", True, float("nan")):
        with pytest.raises(BadExtraConfig, match="stuck_step_dump_s"):
            stuck_step_dump_s({"stuck_step_dump_s": bad})
    with pytest.raises(BadExtraConfig, match="stuck_step_dump_s"):
        connector_config({"stuck_step_dump_s": "soon"}, engine_id="e", load_failure_policy="fail")
    assert "stuck_step_dump_s" in known_keys()
    connector_config({"stuck_step_dump_s": 30, "lease_s": 5}, engine_id="e", load_failure_policy="fail")


def test_shorten_queue_spin_changes_reader_queues_only() -> None:
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    from kvlink.integrations.vllm.spin import shorten_queue_spin

    class Condition:
        def __init__(self, is_reader: bool) -> None:
            self.is_reader, self.busy_loop_s = is_reader, 1.0

    reader, writer = object.__new__(MessageQueue), object.__new__(MessageQueue)
    reader._spin_condition, writer._spin_condition = Condition(True), Condition(False)  # type: ignore[attr-defined]
    assert shorten_queue_spin(0.002) >= 1
    assert reader._spin_condition.busy_loop_s == 0.002  # type: ignore[attr-defined]
    assert writer._spin_condition.busy_loop_s == 1.0  # type: ignore[attr-defined]
    assert shorten_queue_spin(0.002) == 0, "already short: nothing to change"


def test_each_vllm_start_has_its_own_incarnation() -> None:
    """A P restarted under a fixed engine_id must not serve its earlier start's params: the
    default incarnation is the per-start id the plugin sets; one set in the extra config wins."""
    base = connector_config({}, engine_id="p-fixed", load_failure_policy="fail")
    first, second = with_start_incarnation(base, "f30bb13431ea"), with_start_incarnation(base, "a1f56d45")
    assert first.incarnation == "f30bb13431ea" and first.incarnation != second.incarnation
    assert with_start_incarnation(base, "").incarnation is None
    fixed = connector_config({"incarnation": "mine"}, engine_id="p-fixed", load_failure_policy="fail")
    assert with_start_incarnation(fixed, "17650").incarnation == "mine"


@pytest.mark.parametrize("extra", [{"side_channel_host": "h" * 257}, {"side_channel_host": "a\tb"}])
def test_hosts_a_decoder_would_refuse_are_refused_at_start(extra: dict[str, object]) -> None:
    with pytest.raises(BadExtraConfig, match="side_channel_host: at most 256 printable"):
        connector_config(extra, engine_id="e", load_failure_policy="fail")
    with pytest.raises(BadExtraConfig, match="engine_id: at most 256 printable"):
        connector_config({}, engine_id="e" * 300, load_failure_policy="fail")
