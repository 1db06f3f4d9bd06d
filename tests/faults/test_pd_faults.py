"""Faults injected into a real 1P1D cluster (tiny-hybrid) through the proxy, by PID.

UCX runs over TCP on loopback for this pair (`UCX_TLS=tcp`): over the default CMA path a
SIGSTOPped P is still readable, so only TCP gives a frozen peer whose READ stalls. The
"during a transfer" windows are made deterministic by freezing processes: D is frozen
while P prefills (so the request waits at D, unread), and P is frozen once D's READ is
posted (so the READ is in flight for as long as we want). Each case checks the client's
wait, the answer (reference text or a clear error, never wrong text), that every
surviving instance returns to its initial free blocks with no lease, load or open
transfer, and that the next requests are served normally.
"""

from __future__ import annotations

import os
import signal
import threading
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
    in_background,
    metric,
    prompt_of,
    read_posted_against_frozen_p,
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
# How long D keeps a stalled load's blocks out of use (a late transfer may still write them).
QUARANTINE_S = 3.0
MAX_TOKENS = 8
# What a client may wait, per case: the fault's own deadline plus slack for a busy 2-core box.
SLACK_S = 4.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    config = fault_spec(num_blocks=NUM_BLOCKS, lease_s=LEASE_S, stall_timeout_s=STALL_S,
                        quarantine_s=QUARANTINE_S, env={"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"})
    yield from running_cluster(config, "kvlink-faults")


@pytest.fixture(autouse=True)
def _engines_running(cluster: Cluster) -> None:
    """A case that failed half-way must not leave the next one facing a stopped engine."""
    resume_all(cluster)



def _assert_clean(cluster: Cluster, timeout_s: float) -> dict[str, float]:
    urls = [url_of(cluster, w) for w in ("prefill", "decode") if getattr(cluster, w) is not None
            and getattr(cluster, w).proc.poll() is None]
    return wait_clean(urls, NUM_BLOCKS, timeout_s)


def _ask(cluster: Cluster, i: int, timeout_s: float, max_tokens: int = MAX_TOKENS) -> Result:
    return complete(url_of(cluster, "proxy"), prompt_of(i), max_tokens, timeout_s)


def test_baseline_stream_matches_colocated(cluster: Cluster, expected: Expected) -> None:
    run_stream(url_of(cluster, "proxy"), range(0, 6), expected)
    _assert_clean(cluster, 5)


def test_p_frozen_mid_transfer_stall_deadline_then_resume(cluster: Cluster, expected: Expected) -> None:
    d_url = url_of(cluster, "decode")
    stalls = metric(d_url, "stalled_transfers_total")
    join = read_posted_against_frozen_p(cluster, lambda: _ask(cluster, 100, STALL_S + 2 * SLACK_S))
    try:
        result = join(STALL_S + 2 * SLACK_S)
        # Policy recompute: D prefills locally after the stall deadline; same text as colocated.
        assert result.status == 200 and result.text == expected(prompt_of(100), MAX_TOKENS), result
        assert STALL_S <= result.elapsed_s < STALL_S + SLACK_S, result.elapsed_s
        print(f"[stall/recompute] answered correctly after {result.elapsed_s:.2f}s (stall {STALL_S}s)")
        wait_for(lambda: metric(d_url, "stalled_transfers_total") > stalls, 5, "stall counted")
        assert sum(_quarantined(d_url)) > 0, "a stalled load's blocks must not be reused at once"
        _assert_clean_decode(cluster)
    finally:
        cluster.signal("prefill", signal.SIGCONT)
    # The late completion (P answers the GET after SIGCONT) must not touch reused blocks.
    took = _assert_clean(cluster, LEASE_S + SLACK_S)
    print(f"[stall/recompute] after SIGCONT, clean after {took}")
    run_stream(url_of(cluster, "proxy"), range(101, 107), expected)
    _assert_clean(cluster, 5)


def _quarantined(url: str) -> list[int]:
    state = httpx.get(url + "/debug/state", timeout=5).json()
    return list(state["engine"].get("quarantined_blocks", []))


def _assert_clean_decode(cluster: Cluster) -> None:
    wait_clean([url_of(cluster, "decode")], NUM_BLOCKS, QUARANTINE_S + 5)


def test_p_killed_mid_transfer(cluster: Cluster, expected: Expected) -> None:
    join = read_posted_against_frozen_p(cluster, lambda: _ask(cluster, 200, STALL_S + 2 * SLACK_S))
    killed = time.monotonic()
    cluster.signal("prefill", signal.SIGKILL)
    result = join(STALL_S + 2 * SLACK_S)
    assert result.status == 200 and result.text == expected(prompt_of(200), MAX_TOKENS), result
    # A dead peer is detected by the transport, well before the stall deadline.
    assert time.monotonic() - killed < STALL_S, "D waited for the stall deadline, not the disconnect"
    print(f"[P killed mid-transfer] answered correctly {time.monotonic() - killed:.2f}s after the kill")
    wait_for(lambda: metric(url_of(cluster, "decode"), "failed_transfers_total") >= 1, 5, "failure counted")
    _assert_clean_decode(cluster)
    cluster.restart("prefill")
    run_stream(url_of(cluster, "proxy"), range(201, 205), expected)
    _assert_clean(cluster, 5)


def _ask_with_id(cluster: Cluster, i: int, request_id: str, timeout_s: float) -> Result:
    started = time.monotonic()
    body = {"prompt": prompt_of(i), "max_tokens": MAX_TOKENS, "temperature": 0}
    try:
        r = httpx.post(url_of(cluster, "proxy") + "/v1/completions", json=body, timeout=timeout_s,
                       headers={"X-Request-Id": request_id})
    except httpx.HTTPError as error:
        return Result(None, None, repr(error), time.monotonic() - started)
    text = r.json()["choices"][0]["text"] if r.status_code == 200 else None
    return Result(r.status_code, text, None if text is not None else r.text, time.monotonic() - started)


def test_p_restarted_same_engine_id_with_requests_of_both_lives(cluster: Cluster, expected: Expected) -> None:
    """P dies and comes back (same engine id and port) while D's view of it is stale. Then D
    gets (a) params the old P made (the test plays the router: asked P, then P died) and
    (b) a request the new P prefilled, through the proxy, at the same time. D re-handshakes
    once; (b) loads over NIXL from the new P; (a) must not be read from the new P's memory
    (its blocks hold nothing there): it is recomputed, because its params expired with the
    old P's lease (a restart outlasts LEASE_S) or, were they still valid, because D sees the
    new incarnation and fails the load. Never wrong text."""
    d_url, p_url = url_of(cluster, "decode"), url_of(cluster, "prefill")
    assert cluster.member("prefill").engine_id in connector(cluster, "decode")["remote_engines"]
    tag = f"rs{os.getpid()}"
    old_params = httpx.post(p_url + "/v1/completions", timeout=30, json={
        "prompt": prompt_of(300), "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True}}).json()["kv_transfer_params"]
    cluster.signal("prefill", signal.SIGKILL)
    cluster.restart("prefill")

    def old() -> Result:
        started = time.monotonic()
        r = httpx.post(d_url + "/v1/completions", timeout=30, headers={"X-Request-Id": f"{tag}-old"},
                       json={"prompt": prompt_of(300), "max_tokens": MAX_TOKENS, "temperature": 0,
                             "kv_transfer_params": old_params})
        text = r.json()["choices"][0]["text"] if r.status_code == 200 else None
        return Result(r.status_code, text, None if text is not None else r.text, time.monotonic() - started)

    joins = [(in_background(old), 300),
             (in_background(lambda: _ask_with_id(cluster, 301, f"{tag}-new", 30)), 301)]
    for join, i in joins:
        result = join(30)
        assert result.status == 200 and result.text == expected(prompt_of(i), MAX_TOKENS), (i, result)
    assert cluster.decode is not None
    log = cluster.decode.log_path.read_text(errors="replace")
    refused_as = (f"request {tag}-old: kv_transfer_params expired", "restarted after prefilling")
    assert any(reason in log for reason in refused_as), f"{tag}-old was not refused as stale"
    new_line = next(line for line in log.splitlines() if f"request {tag}-new role=decode" in line)
    assert "kv_bytes=" in new_line and "kv_bytes=0 " not in new_line, new_line  # loaded, not recomputed
    print(f"[P restarted] old-life request recomputed, new-life one loaded: {new_line.split('role=')[1]}")
    _assert_clean(cluster, LEASE_S + SLACK_S)
    run_stream(url_of(cluster, "proxy"), range(302, 305), expected)


def test_d_killed_with_the_request_accepted_p_frees_on_lease_expiry(
        cluster: Cluster, expected: Expected) -> None:
    # D dies after accepting the request and before its READ completes. (Killing D while its
    # READ waits on a non-progressing P over TCP aborts P inside UCX: see RELIABILITY.md.)
    join = request_parked_at_decode(cluster, lambda: _ask(cluster, 400, 30))
    cluster.signal("decode", signal.SIGKILL)
    result = join(10)
    assert result.status == 502 and result.error and "decode" in result.error, result
    print(f"[D killed] client got 502 after {result.elapsed_s:.2f}s")
    took = wait_clean([url_of(cluster, "prefill")], NUM_BLOCKS, LEASE_S + SLACK_S)
    wait_for(lambda: metric(url_of(cluster, "prefill"), "expired_leases_total") >= 1, 5, "expiry counted")
    print(f"P free again {took} s after D's death (lease {LEASE_S} s)")
    # The next cases run D with policy `fail`: a failed load is a clear error, never wrong text.
    cluster.restart("decode", extra_args=["--load-failure-policy", "fail"])
    run_stream(url_of(cluster, "proxy"), range(401, 405), expected)
    _assert_clean(cluster, 5)


def test_p_killed_before_d_reads_policy_fail(cluster: Cluster, expected: Expected) -> None:
    join = request_parked_at_decode(cluster, lambda: _ask(cluster, 500, 30))
    try:
        cluster.signal("prefill", signal.SIGKILL)
    finally:
        cluster.signal("decode", signal.SIGCONT)
    resumed = time.monotonic()
    result = join(15)
    # D's re-handshake finds nobody listening: D answers a retryable 502 (P is at fault, not
    # the client), saying what failed, and the proxy passes it on.
    assert result.status == 502 and result.error and "Connection refused" in result.error, result
    assert "failed (HTTP 502)" in result.error and "load_failure_policy" in result.error
    assert time.monotonic() - resumed < 5 + SLACK_S  # handshake timeout (5 s) bounds the retry
    print(f"[P killed before read/fail] 502 {time.monotonic() - resumed:.2f}s after D resumed")
    _assert_clean_decode(cluster)
    cluster.restart("prefill")
    run_stream(url_of(cluster, "proxy"), range(501, 505), expected)
    _assert_clean(cluster, 5)


def test_p_frozen_mid_transfer_policy_fail(cluster: Cluster, expected: Expected) -> None:
    join = read_posted_against_frozen_p(cluster, lambda: _ask(cluster, 600, STALL_S + 2 * SLACK_S))
    try:
        result = join(STALL_S + 2 * SLACK_S)
        # Past D's stall deadline: D answers 504 (a deadline, retryable), the proxy passes it on.
        assert result.status == 504 and result.error and "load_failure_policy" in result.error, result
        assert "stalled" in result.error and "failed (HTTP 504)" in result.error
        assert result.elapsed_s < STALL_S + SLACK_S
        assert sum(_quarantined(url_of(cluster, "decode"))) > 0
        print(f"[stall/fail] 504 after {result.elapsed_s:.2f}s")
        _assert_clean_decode(cluster)
    finally:
        cluster.signal("prefill", signal.SIGCONT)
    _assert_clean(cluster, LEASE_S + SLACK_S)
    run_stream(url_of(cluster, "proxy"), range(601, 605), expected)


def _stream_lines(url: str, i: int, max_tokens: int, stop_after: int | None,
                  lines: list[str], errors: list[str]) -> None:
    body = {"prompt": prompt_of(i), "max_tokens": max_tokens, "temperature": 0, "stream": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=20) as response:
            for line in response.iter_lines():
                if line.startswith("data:"):
                    lines.append(line)
                if stop_after is not None and len(lines) >= stop_after:
                    return  # leaving the with-block closes the connection
    except httpx.HTTPError as error:
        errors.append(repr(error))


def test_proxy_restarted_with_requests_in_flight(cluster: Cluster, expected: Expected) -> None:
    streams: list[tuple[list[str], list[str]]] = [([], []) for _ in range(4)]
    threads = [threading.Thread(target=_stream_lines, args=(url_of(cluster, "proxy"), 700 + k, 400, None,
                                                            *streams[k]), daemon=True)
               for k in range(4)]
    for t in threads:
        t.start()
    wait_for(lambda: sum(1 for lines, _ in streams if lines) >= 2, 15, "two streams under way")
    killed = time.monotonic()
    cluster.signal("proxy", signal.SIGKILL)
    for t in threads:
        t.join(5)
        assert not t.is_alive(), "a client kept waiting after the proxy died"
    print(f"clients released {time.monotonic() - killed:.2f}s after the proxy died")
    for lines, errors in streams:
        finished = bool(lines) and lines[-1] == "data: [DONE]"
        assert errors or finished, "a stream ended without [DONE] and without an error"
    took = _assert_clean(cluster, LEASE_S + SLACK_S)
    print(f"[proxy killed] instances clean after {took}")
    cluster.restart("proxy")
    run_stream(url_of(cluster, "proxy"), range(710, 714), expected)


def test_client_disconnects_mid_stream_on_d(cluster: Cluster) -> None:
    lines: list[str] = []
    errors: list[str] = []
    _stream_lines(url_of(cluster, "proxy"), 800, 400, 3, lines, errors)
    assert len(lines) == 3 and not errors
    took = _assert_clean(cluster, 5)
    assert took[url_of(cluster, "decode")] < 2.0, took
    print(f"[disconnect mid-stream] clean after {took}")


def test_client_disconnects_mid_prefill_on_p(cluster: Cluster, expected: Expected) -> None:
    d_url = url_of(cluster, "decode")
    d_requests = metric(d_url, "requests_total")
    d_bytes = metric(d_url, "kv_bytes_total")
    cluster.signal("prefill", signal.SIGSTOP)  # P busy: the request is not answered yet
    try:
        result = _ask(cluster, 900, 1.0)
        assert result.status is None  # the client gave up and closed its connection
        time.sleep(0.5)
    finally:
        cluster.signal("prefill", signal.SIGCONT)
    took = _assert_clean(cluster, LEASE_S + SLACK_S)
    print(f"[disconnect mid-prefill] clean after {took}")
    assert metric(d_url, "requests_total") == d_requests, "D got a request nobody waits for"
    assert metric(d_url, "kv_bytes_total") == d_bytes, "KV was transferred for nobody"
    run_stream(url_of(cluster, "proxy"), range(901, 904), expected)
