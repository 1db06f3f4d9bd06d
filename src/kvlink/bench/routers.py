"""The router in front of a local P/D deployment: kvlink's own proxy, or vllm-router.

Both take every P and every D instance; kvlink's proxy picks one of each per request,
vllm-router does the same with its own policy. Only the command line differs.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Sequence

ROUTER_KINDS = ("kvlink", "vllm-router")
VLLM_ROUTER = "vllm-router"
VLLM_ROUTER_PIN = "vllm-router==0.1.17"


def router_argv(kind: str, prefill_urls: Sequence[str], decode_urls: Sequence[str], port: int,
                timeout_s: float) -> list[str]:
    """The command line that starts a router of `kind` on 127.0.0.1:`port`."""
    if not prefill_urls or not decode_urls:
        raise ValueError(f"a router needs at least one prefill and one decode URL; got "
                         f"{len(prefill_urls)} prefill and {len(decode_urls)} decode")
    if kind == "kvlink":
        return [sys.executable, "-m", "kvlink.cli.main", "proxy", "--prefill", *prefill_urls,
                "--decode", *decode_urls, "--port", str(port), "--timeout-s", str(timeout_s)]
    if kind == VLLM_ROUTER:
        executable = shutil.which(VLLM_ROUTER)
        if executable is None:
            raise RuntimeError(f"router 'vllm-router' asked for, but no `{VLLM_ROUTER}` executable "
                               f"is on PATH; install it with `pip install {VLLM_ROUTER_PIN}` "
                               "or use router 'kvlink'")
        return [executable, "--vllm-pd-disaggregation",
                *(arg for url in prefill_urls for arg in ("--prefill", url)),
                *(arg for url in decode_urls for arg in ("--decode", url)),
                "--kv-connector", "nixl", "--host", "127.0.0.1", "--port", str(port)]
    raise ValueError(f"router: expected one of {', '.join(ROUTER_KINDS)}; got {kind!r}")
