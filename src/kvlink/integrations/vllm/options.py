"""`kv_connector_extra_config` → `ConnectorConfig`: kvlink's field names, checked, nothing else.

Pure: imports no vLLM, so the mapping is unit-tested without an engine.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

from kvlink.connector.config import ConnectorConfig
from kvlink.connector.secret import INSECURE_WARNING, load_secret, too_short
from kvlink.transfer.agent_config import AgentConfig
from kvlink.transfer.framing import resolve_secret

log = logging.getLogger("kvlink.connector")

# Set by the integration from vLLM's own config, never from the extra config.
_FROM_VLLM = ("engine_id", "load_failure_policy")
# Extra keys that are not ConnectorConfig fields.
EXTRA_KEYS = ("secret_file", "metrics_port", "nixl_progress_thread", "nixl_progress_delay_us",
              "vllm_queue_busy_poll_ms", "stuck_step_dump_s")
DEFAULT_QUEUE_BUSY_POLL_MS = 2.0
DEFAULT_STUCK_STEP_DUMP_S = 60.0
_INTEGRATION_KEYS = ("metrics_port", "nixl_progress_thread", "nixl_progress_delay_us", "vllm_queue_busy_poll_ms",
                     "stuck_step_dump_s")
DEFAULT_SIDE_CHANNEL_PORT = 5700


def metrics_port(extra: Mapping[str, Any] | None) -> int | None:
    """Base port of kvlink's own per-worker metrics endpoint (rank r: port + r); None: off."""
    port = (extra or {}).get("metrics_port")
    if port is None:
        return None
    if type(port) is not int or not 1 <= port <= 65535:
        raise BadExtraConfig(f"kvlink: metrics_port must be a port number, got {port!r}")
    return port


def agent_config(extra: Mapping[str, Any] | None) -> AgentConfig:
    """The worker's NIXL agent settings. Inside vLLM the progress thread is off by default:
    the worker drives UCX when it polls (every engine step, and vLLM keeps stepping an engine
    while kvlink holds leases or waits for loads). With the thread on (its poll timeout
    patched from NIXL's 0 to `nixl_progress_delay_us`), it still spun a core whenever a peer
    connection had work in flight, and it inherits the worker's pinned core: a P worker and a
    D worker pinned to one core then starved the D until P's lease ran out (docs/vllm.md)."""
    values = extra or {}
    thread = values.get("nixl_progress_thread", False)
    delay = values.get("nixl_progress_delay_us", 10_000)
    if not isinstance(thread, bool):
        raise BadExtraConfig(f"kvlink: nixl_progress_thread must be true or false, got {thread!r}")
    if type(delay) is not int or not 1 <= delay <= 1_000_000:
        raise BadExtraConfig(f"kvlink: nixl_progress_delay_us must be an integer in [1, 1000000], got {delay!r}")
    return AgentConfig(progress_thread=thread, progress_delay_us=delay)


def _nullable_number(extra: Mapping[str, Any] | None, key: str, default: float,
                     in_range: Callable[[float], bool], wanted: str) -> float | None:
    """`key`'s number (`default` when absent); None when set to null; else BadExtraConfig
    saying it must be `wanted`."""
    values = extra or {}
    if key in values and values[key] is None:
        return None
    value = values.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not in_range(value):
        raise BadExtraConfig(f"kvlink: {key} must be {wanted}, got {value!r}")
    return float(value)


def queue_busy_poll_s(extra: Mapping[str, Any] | None) -> float | None:
    """How long vLLM's queue readers in kvlink's processes busy-poll after a message
    (`kvlink.integrations.vllm.spin`), in seconds; None: leave vLLM's 1 s alone (the key
    set to null)."""
    ms = _nullable_number(extra, "vllm_queue_busy_poll_ms", DEFAULT_QUEUE_BUSY_POLL_MS, lambda v: 0 <= v <= 1000,
                          "a number of milliseconds in [0, 1000] or null (vLLM's own 1 s)")
    return None if ms is None else ms / 1e3


def stuck_step_dump_s(extra: Mapping[str, Any] | None) -> float | None:
    """After how many seconds inside one engine step a worker writes its threads' stacks to
    the log (`kvlink.integrations.vllm.stuck_step`); None: never (the key set to null)."""
    return _nullable_number(extra, "stuck_step_dump_s", DEFAULT_STUCK_STEP_DUMP_S, lambda v: 0 < v <= 86400,
                            "a number of seconds in (0, 86400] or null (no stack dumps)")


def known_keys() -> tuple[str, ...]:
    fields = [f.name for f in dataclasses.fields(ConnectorConfig) if f.name not in _FROM_VLLM]
    return tuple(sorted([*fields, *EXTRA_KEYS]))


class BadExtraConfig(ValueError):
    """The extra config cannot make a ConnectorConfig; the message says what to change."""


def connector_config(
    extra: Mapping[str, Any] | None, *, engine_id: str, load_failure_policy: str,
) -> ConnectorConfig:
    """Build the connector config of one vLLM engine from its extra config.

    `engine_id` and `load_failure_policy` come from vLLM's `kv_transfer_config` (the
    engine id is shared by the scheduler process and every worker process). `secret` is
    text in JSON; `secret_file` reads it from a file; neither: `$KVLINK_SECRET`.
    """
    values = dict(extra or {})
    for key in _INTEGRATION_KEYS:
        values.pop(key, None)  # see metrics_port(), agent_config(), queue_busy_poll_s(), stuck_step_dump_s()
    unknown = sorted(set(values) - set(known_keys()))
    metrics_port(extra)
    agent_config(extra)
    queue_busy_poll_s(extra)
    stuck_step_dump_s(extra)
    if unknown:
        raise BadExtraConfig(
            f"kvlink: unknown kv_connector_extra_config keys {unknown}; known keys: "
            f"{', '.join(known_keys())}")
    secret_file = values.pop("secret_file", None)
    if "secret" in values and secret_file is not None:
        raise BadExtraConfig("kvlink: give either 'secret' or 'secret_file', not both")
    if secret_file is not None:
        if not isinstance(secret_file, str):
            raise BadExtraConfig(f"kvlink: secret_file must be a path, got {secret_file!r}")
        try:
            values["secret"] = load_secret(secret_file)
        except ValueError as exc:
            raise BadExtraConfig(f"kvlink: {exc}") from None
    elif "secret" in values:
        secret = values["secret"]
        if not isinstance(secret, str) or not secret.strip():
            raise BadExtraConfig("kvlink: secret must be a non-empty string")
        values["secret"] = secret.strip().encode()
        if (why := too_short(values["secret"], "kv_connector_extra_config's secret")) is not None:
            raise BadExtraConfig(f"kvlink: {why}")
    if values.get("transfer_mode") == "layerwise":
        raise BadExtraConfig("kvlink: transfer_mode layerwise is chosen per request (kvlink proxy --mode "
                             "layerwise sends kv_transfer_params.transfer_mode), not as an engine default; "
                             "use pull or push here")
    values.setdefault("side_channel_port", DEFAULT_SIDE_CHANNEL_PORT)
    if values["side_channel_port"] == 0:
        raise BadExtraConfig(
            "kvlink: side_channel_port must be a fixed port inside vLLM (rank r listens on "
            "port + r, and the scheduler process advertises it); 0 (ephemeral) is not supported")
    for key in ("lease_s", "stall_timeout_s", "quarantine_s", "handshake_timeout_s", "engine_ttl_s"):
        if key in values and type(values[key]) is int:
            values[key] = float(values[key])
    try:
        config = ConnectorConfig(engine_id=engine_id, load_failure_policy=load_failure_policy,  # type: ignore[arg-type]
                                 **values)
    except (TypeError, ValueError) as exc:
        raise BadExtraConfig(f"kvlink: bad kv_connector_extra_config: {exc}") from None
    if config.insecure_unsigned_params and resolve_secret(config.secret) is None:
        log.warning("kvlink: %s", INSECURE_WARNING)
    return config


def with_start_incarnation(config: ConnectorConfig, start_id: str) -> ConnectorConfig:
    """The config with this vLLM start's incarnation, unless the extra config set one.
    `start_id` is the server's `$KVLINK_VLLM_START` (`plugin.START_ENV`): set by its first
    process and inherited by the engine core and the workers, so all of one start agree on
    it (vLLM's own `instance_id` is not: it is set again whenever a config is copied), and a
    P restarted under a fixed `engine_id` gets another (D then refuses the earlier start's
    params)."""
    start = str(start_id or "")
    if config.incarnation is not None or not start:
        return config
    return dataclasses.replace(config, incarnation=start)
