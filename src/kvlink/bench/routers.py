"""The router in front of a local P/D deployment: kvlink's own proxy, or vllm-router.

Both take every P and every D instance; kvlink's proxy picks one of each per request,
vllm-router does the same with its own policy. Only the command line differs.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

ROUTER_KINDS = ("kvlink", "vllm-router")
VLLM_ROUTER = "vllm-router"
VLLM_ROUTER_PIN = "vllm-router==0.1.17"
VLLM_ROUTER_POLICIES = ("random", "round_robin", "cache_aware", "kv_aware", "power_of_two",
                        "consistent_hash", "sticky_least_loaded")


def vllm_router_executable() -> str | None:
    """`vllm-router` next to this interpreter (a venv that is not activated), else on PATH."""
    beside = Path(sys.executable).parent / VLLM_ROUTER
    if beside.is_file() and shutil.which(str(beside)) is not None:
        return str(beside)
    return shutil.which(VLLM_ROUTER)


def vllm_router_flags(policy: str | None = None, health_check_interval_s: int | None = None,
                      health_failure_threshold: int | None = None,
                      max_retries: int | None = None) -> list[str]:
    """vllm-router options for the policy (P and D alike), its health check and its retries.

    None leaves vllm-router's own default (cache_aware, a health check every 60 s that takes
    an instance out after 3 failures, 5 tries). `max_retries` counts tries, the first included.
    """
    flags: list[str] = []
    if policy is not None:
        if policy not in VLLM_ROUTER_POLICIES:
            raise ValueError(f"policy: expected one of {', '.join(VLLM_ROUTER_POLICIES)}; got {policy!r}")
        flags += ["--policy", policy]
    for option, value, flag in (("health_check_interval_s", health_check_interval_s,
                                 "--health-check-interval-secs"),
                                ("health_failure_threshold", health_failure_threshold,
                                 "--health-failure-threshold"),
                                ("max_retries", max_retries, "--retry-max-retries")):
        if value is None:
            continue
        if not 1 <= value <= 3600:
            raise ValueError(f"{option}: expected 1 to 3600; got {value}")
        flags += [flag, str(value)]
    return flags


def router_argv(kind: str, prefill_urls: Sequence[str], decode_urls: Sequence[str], port: int,
                timeout_s: float, extra_args: Sequence[str] = (), metrics_port: int | None = None) -> list[str]:
    """The command line that starts a router of `kind` on 127.0.0.1:`port`; `extra_args` last.

    vllm-router also serves Prometheus metrics, on 127.0.0.1:29000 unless `metrics_port` is
    given: two routers on one host need different ones.
    """
    if not prefill_urls or not decode_urls:
        raise ValueError(f"a router needs at least one prefill and one decode URL; got "
                         f"{len(prefill_urls)} prefill and {len(decode_urls)} decode")
    if kind == "kvlink":
        return [sys.executable, "-m", "kvlink.cli.main", "proxy", "--prefill", *prefill_urls,
                "--decode", *decode_urls, "--port", str(port), "--timeout-s", str(timeout_s),
                *extra_args]
    if kind == VLLM_ROUTER:
        executable = vllm_router_executable()
        if executable is None:
            raise RuntimeError(f"router 'vllm-router' asked for, but no `{VLLM_ROUTER}` executable "
                               f"is next to {sys.executable} or on PATH; install it with "
                               f"`pip install {VLLM_ROUTER_PIN}` or use router 'kvlink'")
        return [executable, "--vllm-pd-disaggregation",
                *(arg for url in prefill_urls for arg in ("--prefill", url)),
                *(arg for url in decode_urls for arg in ("--decode", url)),
                "--kv-connector", "nixl", "--host", "127.0.0.1", "--port", str(port),
                *(("--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port))
                  if metrics_port is not None else ()), *extra_args]
    raise ValueError(f"router: expected one of {', '.join(ROUTER_KINDS)}; got {kind!r}")
