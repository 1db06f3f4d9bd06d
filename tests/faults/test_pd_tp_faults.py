"""A TP rank of P dies or freezes: real tiny-hybrid cluster with P at TP 2 and D at TP 1, through the proxy.

P's rank 1 is a follower process (`engine.tp_worker`) that rank 0 drives over gloo, and
that D reads half of every page from. Killing it must end in clear answers, never a hang
or wrong text: D's load from the dead rank fails and D recomputes; P's engine, whose
next collective finds the rank gone, stops serving with an error; a restarted P serves
again and the cluster returns to its initial state.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import httpx
import pytest
from pd_faults import (
    Expected,
    complete,
    fault_spec,
    prompt_of,
    request_parked_at_decode,
    resume_all,
    run_stream,
    running_cluster,
    url_of,
)

from kvlink.bench.cluster import Cluster
from kvlink.bench.instance_state import wait_clean

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NUM_BLOCKS = 64
LEASE_S = 3.0
STALL_S = 2.0
MAX_TOKENS = 8
SLACK_S = 6.0
STEP_TIMEOUT_S = 4.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    config = fault_spec(num_blocks=NUM_BLOCKS, lease_s=LEASE_S, stall_timeout_s=STALL_S,
                        quarantine_s=3.0, env={"UCX_NET_DEVICES": "lo"}, prefill_tp=2,
                        prefill_args=["--tp-step-timeout-s", str(STEP_TIMEOUT_S)])
    yield from running_cluster(config, "kvlink-tp-faults")


@pytest.fixture(autouse=True)
def _engines_running(cluster: Cluster) -> None:
    """A case that failed half-way must not leave the next one facing a stopped engine."""
    resume_all(cluster)



def _follower_pid(cluster: Cluster) -> int:
    """P's TP rank 1: the one child of P's server process running `kvlink.engine.tp_worker`."""
    assert cluster.prefill is not None
    parent = cluster.prefill.proc.pid
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and b"tp_worker" in cmdline:
            found.append(int(entry))
    assert len(found) == 1, f"expected one follower of P (pid {parent}), found {found}"
    return found[0]


def test_p_follower_rank_killed_with_a_load_pending(cluster: Cluster, expected: Expected) -> None:
    proxy, decode = url_of(cluster, "proxy"), url_of(cluster, "decode")
    run_stream(proxy, range(0, 3), expected)  # TP 2 -> 1 works, D knows both P ranks
    # P prefilled and holds the request; D (frozen) has not read it yet. P's rank 1 dies.
    join = request_parked_at_decode(cluster, lambda: complete(proxy, prompt_of(10), MAX_TOKENS, 40))
    follower = _follower_pid(cluster)
    try:
        os.kill(follower, signal.SIGKILL)
    finally:
        cluster.signal("decode", signal.SIGCONT)
    resumed = time.monotonic()
    result = join(STALL_S + 2 * SLACK_S)
    # D cannot read rank 1's half: the load fails and D recomputes. Right text, bounded wait.
    assert result.status == 200 and result.text == expected(prompt_of(10), MAX_TOKENS), result
    assert time.monotonic() - resumed < STALL_S + SLACK_S
    print(f"[P rank 1 killed] answer by recompute {time.monotonic() - resumed:.2f}s after D resumed")
    # P's engine finds the rank gone at its next collective: requests get an error, not a hang.
    started = time.monotonic()
    broken = complete(proxy, prompt_of(11), MAX_TOKENS, 30)
    # P's engine is dead: 503 engine_dead from P, which the proxy passes on.
    assert broken.status == 503 and broken.text is None, broken
    assert time.monotonic() - started < 20, f"P took {time.monotonic() - started:.1f}s to fail"
    health = httpx.get(url_of(cluster, "prefill") + "/health", timeout=5)
    print(f"[P rank 1 killed] next request: HTTP {broken.status} after {time.monotonic() - started:.2f}s; "
          f"P /health {health.status_code}")
    assert health.status_code != 200, "P reports healthy with a dead TP rank"
    wait_clean([decode], NUM_BLOCKS, 3.0 + SLACK_S)  # D: nothing held (after its quarantine)
    cluster.restart("prefill")
    run_stream(proxy, range(12, 16), expected)
    wait_clean([url_of(cluster, "prefill"), decode], NUM_BLOCKS, LEASE_S + SLACK_S)


def test_p_follower_rank_frozen_fails_the_engine_at_the_step_timeout(
        cluster: Cluster, expected: Expected) -> None:
    """A rank that stops answering (SIGSTOP) would hold rank 0 in its next all-reduce; the
    step collectives' timeout (`--tp-step-timeout-s`) turns that into an engine error."""
    proxy = url_of(cluster, "proxy")
    run_stream(proxy, range(20, 22), expected)
    follower = _follower_pid(cluster)
    os.kill(follower, signal.SIGSTOP)
    try:
        started = time.monotonic()
        result = complete(proxy, prompt_of(22), MAX_TOKENS, STEP_TIMEOUT_S + 3 * SLACK_S)
        took = time.monotonic() - started
        assert result.status == 503 and result.text is None, result
        assert STEP_TIMEOUT_S - 1 <= took < STEP_TIMEOUT_S + SLACK_S, took
        assert httpx.get(url_of(cluster, "prefill") + "/health", timeout=5).status_code != 200
        print(f"[P rank 1 frozen] HTTP {result.status} after {took:.2f}s (step timeout {STEP_TIMEOUT_S}s)")
    finally:
        os.kill(follower, signal.SIGKILL)
    cluster.restart("prefill")
    run_stream(proxy, range(23, 26), expected)
    wait_clean([url_of(cluster, "prefill"), url_of(cluster, "decode")], NUM_BLOCKS, LEASE_S + SLACK_S)
