"""Agent configuration and construction of the raw NIXL agent (progress-thread delay, UCX env log)."""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

from kvlink.transfer import nixl_import

logger = logging.getLogger(__name__)

UCX_ENV_KEYS: tuple[str, ...] = ("UCX_TLS", "UCX_NET_DEVICES")


@dataclass(frozen=True)
class AgentConfig:
    """How one worker's NIXL agent is built.

    ``progress_thread`` is off by default: the stock UCX progress thread polls
    with a zero timeout and burns a whole core per agent. Without it, the owner
    must call ``get_notifs()`` (or poll transfers) regularly so peers progress.
    When it is on, ``progress_delay_us`` becomes the thread's poll timeout.
    """

    backend: str = "UCX"
    progress_thread: bool = False
    progress_delay_us: int = 1000
    num_threads: int = 0
    capture_telemetry: bool = True

    def __post_init__(self) -> None:
        if self.progress_delay_us <= 0:
            raise ValueError(
                f"progress_delay_us must be > 0 (got {self.progress_delay_us}); "
                "0 makes the UCX progress thread spin at 100% of a core"
            )
        if self.num_threads < 0:
            raise ValueError(f"num_threads must be >= 0, got {self.num_threads}")


class _DelayedBindings:
    """Stands in for the bindings module while one agent is built; sets ``pthrDelay``.

    ``nixl_agent.__init__`` writes ``pthrDelay = 0`` into its config just before
    constructing the native agent, so the only seam is the native constructor.
    """

    def __init__(self, real: Any, delay_us: int) -> None:
        self._real = real
        self._delay_us = delay_us

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._real, attr)

    def nixlAgent(self, name: str, native_config: Any) -> Any:
        native_config.pthrDelay = self._delay_us
        return self._real.nixlAgent(name, native_config)


_construct_lock = threading.Lock()
_ucx_env_logged = False


def log_ucx_env_once() -> None:
    """Log the UCX transport environment the first time an agent is created."""
    global _ucx_env_logged
    if _ucx_env_logged:
        return
    _ucx_env_logged = True
    settings = ", ".join(f"{key}={os.environ.get(key, '<unset>')}" for key in UCX_ENV_KEYS)
    logger.info("NIXL package %s; UCX environment: %s", nixl_import.PACKAGE_NAME, settings)
    if "UCX_NET_DEVICES" not in os.environ:
        logger.warning(
            "UCX_NET_DEVICES is unset: UCX listens on and advertises every interface; "
            "set UCX_NET_DEVICES=lo for single-host use"
        )


def create_raw_agent(name: str, config: AgentConfig) -> Any:
    """Build a ``nixl_agent`` for ``config``; raises if the backend could not be created."""
    log_ucx_env_once()
    raw_config = nixl_import.nixl_agent_config(
        enable_prog_thread=config.progress_thread,
        enable_listen_thread=False,
        capture_telemetry=config.capture_telemetry,
        num_threads=config.num_threads,
        backends=[config.backend],
    )
    api = nixl_import.api
    if config.progress_thread:
        with _construct_lock:
            real = api.nixlBind
            api.nixlBind = _DelayedBindings(real, config.progress_delay_us)
            try:
                agent = nixl_import.nixl_agent(name, raw_config)
            finally:
                api.nixlBind = real
    else:
        agent = nixl_import.nixl_agent(name, raw_config)
    if config.backend not in agent.backends:
        raise RuntimeError(
            f"NIXL backend {config.backend!r} could not be created for agent {name!r} "
            f"(plugins found: {agent.get_plugin_list()}); check the NIXL install and UCX_TLS"
        )
    return agent
