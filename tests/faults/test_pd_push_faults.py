"""Faults in push mode (`--transfer-mode push`: P WRITEs into the blocks D announced), on a
real 1P1D tiny-hybrid cluster through the proxy, by PID. UCX over TCP on loopback, as in
`test_pd_faults.py`, so that a frozen P really stops moving data.

The push-specific hazard: D gives up on a push that never came (P frozen), but a P that
resumes later still holds the push request and WRITEs into D's blocks. Those blocks must
stay out of use (quarantined) so the late WRITE cannot land in another request's KV.
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
    Result,
    complete,
    connector,
    fault_spec,
    metric,
    prompt_of,
    request_parked_at_decode,
    resume_all,
    run_stream,
    running_cluster,
    url_of,
    wait_for,
)

from kvlink.bench.cluster import Cluster
from kvlink.bench.instance_state import wait_clean

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

NUM_BLOCKS = 64
LEASE_S = 3.0
STALL_S = 2.0
HANDSHAKE_S = 5.0  # the serve default; D's push deadline is stall + handshake timeout
QUARANTINE_S = 12.0
MAX_TOKENS = 8
SLACK_S = 4.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    config = fault_spec(num_blocks=NUM_BLOCKS, lease_s=LEASE_S, stall_timeout_s=STALL_S,
                        quarantine_s=QUARANTINE_S, env={"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"},
                        transfer_mode="push")
    yield from running_cluster(config, "kvlink-push-faults")


@pytest.fixture(autouse=True)
def _engines_running(cluster: Cluster) -> None:
    """A case that failed half-way must not leave the next one facing a stopped engine."""
    resume_all(cluster)



def _ask(cluster: Cluster, i: int, timeout_s: float) -> Result:
    return complete(url_of(cluster, "proxy"), prompt_of(i), MAX_TOKENS, timeout_s)


def _clean(cluster: Cluster, timeout_s: float) -> None:
    urls = [url_of(cluster, w) for w in ("prefill", "decode") if getattr(cluster, w).proc.poll() is None]
    wait_clean(urls, NUM_BLOCKS, timeout_s)


def test_push_answers_match_colocated_and_p_does_the_writing(cluster: Cluster, expected: Expected) -> None:
    prefill, decode = url_of(cluster, "prefill"), url_of(cluster, "decode")
    run_stream(url_of(cluster, "proxy"), range(0, 4), expected)
    assert metric(prefill, "kvlink_bytes_total") > 0 and metric(prefill, "kvlink_transfers_total") >= 4
    assert metric(decode, "kvlink_transfers_total") == 0  # D posted nothing: P wrote
    _clean(cluster, 5)


def test_p_frozen_before_pushing_late_write_lands_in_quarantined_blocks(
        cluster: Cluster, expected: Expected) -> None:
    prefill, decode = url_of(cluster, "prefill"), url_of(cluster, "decode")
    run_stream(url_of(cluster, "proxy"), range(299, 300), expected)  # D and P know each other
    writes_before = metric(prefill, "kvlink_transfers_total")
    # P prefilled and holds the request; D (frozen until now) announces its blocks while P is
    # frozen, so the push request waits in P's socket.
    join = request_parked_at_decode(cluster, lambda: _ask(cluster, 300, HANDSHAKE_S + STALL_S + 2 * SLACK_S))
    cluster.signal("prefill", signal.SIGSTOP)
    try:
        cluster.signal("decode", signal.SIGCONT)
        resumed = time.monotonic()
        wait_for(lambda: connector(cluster, "decode")["loads_in_flight"] >= 1, 10, "D waiting for the push")
        result = join(HANDSHAKE_S + STALL_S + 2 * SLACK_S)
        waited = time.monotonic() - resumed
        # D gave up at its push deadline and recomputed: the right text, never a hang.
        assert result.status == 200 and result.text == expected(prompt_of(300), MAX_TOKENS), result
        assert STALL_S <= waited < HANDSHAKE_S + STALL_S + SLACK_S, waited
        assert metric(decode, "stalled_transfers_total") >= 1
        # The blocks D announced are out of use while a late WRITE may still come.
        quarantined = cluster.state("decode")["engine"]["quarantined_blocks"]
        assert sum(quarantined) > 0, quarantined
    finally:
        cluster.signal("prefill", signal.SIGCONT)
    print(f"[push, P frozen] D answered by recompute {waited:.2f}s after it resumed")
    # P wakes up holding the push request: its WRITE (if it still makes one) lands in the
    # quarantined blocks. Everything D serves meanwhile is still right.
    run_stream(url_of(cluster, "proxy"), range(301, 305), expected)
    for i in (305, 306):
        direct = complete(decode, prompt_of(i), MAX_TOKENS, 30)
        assert direct.status == 200 and direct.text == expected(prompt_of(i), MAX_TOKENS), direct
    late_writes = metric(prefill, "kvlink_transfers_total") - writes_before - 4  # 4 pushes of 301..304
    print(f"[push, P frozen] late WRITEs after P resumed: {late_writes}")
    # Once the quarantine is over, every block is back and nothing is held anywhere.
    _clean(cluster, QUARANTINE_S + SLACK_S)


def test_p_restarted_params_of_its_old_life_fail_fast(cluster: Cluster, expected: Expected) -> None:
    """P dies and comes back under the same engine id; D gets params the old P made (the test
    plays the router). D must not ask the new P to push blocks that hold nothing: it recomputes
    at once, not at its push deadline, because the params expired with the old P's lease (a
    restart outlasts LEASE_S) or, were they still valid, because it sees the new incarnation."""
    d_url, p_url = url_of(cluster, "decode"), url_of(cluster, "prefill")
    run_stream(url_of(cluster, "proxy"), range(349, 350), expected)  # D knows this P
    old_params = httpx.post(p_url + "/v1/completions", timeout=30, json={
        "prompt": prompt_of(350), "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True}}).json()["kv_transfer_params"]
    cluster.signal("prefill", signal.SIGKILL)
    cluster.restart("prefill")
    started = time.monotonic()
    r = httpx.post(d_url + "/v1/completions", timeout=30, headers={"X-Request-Id": f"old-{os.getpid()}"},
                   json={"prompt": prompt_of(350), "max_tokens": MAX_TOKENS, "temperature": 0,
                         "kv_transfer_params": old_params})
    took = time.monotonic() - started
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected(prompt_of(350), MAX_TOKENS)
    assert took < STALL_S, f"D waited {took:.2f}s: it asked the new P for a push"
    assert cluster.decode is not None
    log = cluster.decode.log_path.read_text(errors="replace")
    refused_as = (f"request old-{os.getpid()}: kv_transfer_params expired", "restarted after prefilling")
    assert any(reason in log for reason in refused_as), "the old-life request was not refused as stale"
    print(f"[push, P restarted] old-life request recomputed after {took:.2f}s")
    run_stream(url_of(cluster, "proxy"), range(351, 354), expected)
    _clean(cluster, LEASE_S + SLACK_S)


def test_d_killed_with_the_request_accepted_p_frees_on_lease_expiry(
        cluster: Cluster, expected: Expected) -> None:
    run_stream(url_of(cluster, "proxy"), range(399, 400), expected)  # P holds a connection to this D
    join = request_parked_at_decode(cluster, lambda: _ask(cluster, 400, 30))
    cluster.signal("decode", signal.SIGKILL)
    result = join(10)
    assert result.status == 502 and result.error and "decode" in result.error, result
    wait_clean([url_of(cluster, "prefill")], NUM_BLOCKS, LEASE_S + SLACK_S)
    assert metric(url_of(cluster, "prefill"), "expired_leases_total") >= 1
    cluster.restart("decode")
    # The new D has the old one's engine id: P's first WRITE goes to the dead connection,
    # fails, and P pushes again after a fresh handshake — no wait for D's push deadline.
    first = _ask(cluster, 401, 30)
    assert first.status == 200 and first.text == expected(prompt_of(401), MAX_TOKENS), first
    assert first.elapsed_s < STALL_S, f"the push waited for D's deadline ({first.elapsed_s:.2f}s)"
    assert metric(url_of(cluster, "decode"), "stalled_transfers_total") == 0
    print(f"[push, D restarted] first request {first.elapsed_s:.2f}s")
    run_stream(url_of(cluster, "proxy"), range(402, 405), expected)
    _clean(cluster, 5)
