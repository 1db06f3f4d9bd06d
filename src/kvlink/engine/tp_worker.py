"""A follower TP rank process: loads its shard, registers its KV memory, mirrors rank 0.

Started by `launch_followers` with one JSON argument; it dies with its parent. The shared
secret travels in the environment (`$KVLINK_SECRET`), never on the command line, which
every local user can read.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
from dataclasses import asdict
from typing import Any

from kvlink.connector.config import ConnectorConfig
from kvlink.transfer.framing import SECRET_ENV, resolve_secret

PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    """Rank 0 ends a follower: by its shutdown broadcast, or (rank 0 gone) by SIGKILL. Ctrl-C
    and SIGTERM reach the whole process group; a follower that died of them before rank 0
    said shutdown would break rank 0's own orderly stop (a collective with a dead peer)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        sys.exit(1)


def launch_followers(spec: dict[str, Any], connector: ConnectorConfig | None) -> list[subprocess.Popen[bytes]]:
    """Start ranks 1..tp-1; `spec` has model, tp, port, block_size, kernel_block_size, num_blocks."""
    procs = []
    env = dict(os.environ)
    secret = resolve_secret(connector.secret) if connector else None
    if secret is not None:
        env[SECRET_ENV] = secret.decode()
    for rank in range(1, spec["tp"]):
        payload = dict(spec, rank=rank, parent=os.getpid(),
                       connector=_config_dict(connector) if connector else None)
        procs.append(subprocess.Popen([sys.executable, "-m", "kvlink.engine.tp_worker", json.dumps(payload)],
                                      env=env))
    return procs


def _config_dict(config: ConnectorConfig) -> dict[str, Any]:
    data = asdict(config)
    data["secret"] = None  # the follower reads $KVLINK_SECRET (see launch_followers)
    return data


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    _die_with_parent(spec["parent"])
    import torch

    from kvlink.connector.worker import NixlWorker
    from kvlink.engine.kv_cache import allocate_kv_caches, register_with
    from kvlink.engine.models import load_model
    from kvlink.engine.tp import DEFAULT_STEP_TIMEOUT_S, all_reduce, follow, init_group
    from kvlink.transfer.agent_config import AgentConfig

    torch.set_num_threads(1)
    rank, tp = spec["rank"], spec["tp"]
    init_group(rank, tp, spec["port"], float(spec.get("step_timeout_s") or DEFAULT_STEP_TIMEOUT_S))
    model, _ = load_model(spec["model"], rank, tp, all_reduce, progress=lambda line: None)
    caches = allocate_kv_caches(model.spec, tp, spec["block_size"], spec["kernel_block_size"],
                                spec["num_blocks"])
    worker = None
    if spec.get("connector"):
        cfg = dict(spec["connector"])
        worker = NixlWorker(ConnectorConfig(**cfg), model.spec, tp, rank, spec["block_size"],
                            spec["kernel_block_size"], spec["num_blocks"],
                            AgentConfig(progress_thread=bool(spec.get("progress_thread"))))
        worker.register_kv_caches(*register_with(caches))
    follow(model, caches, worker)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
