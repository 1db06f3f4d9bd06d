"""Network partition between P and D: two network namespaces joined by a veth pair.

P runs in one namespace and D in another; UCX uses TCP over the veth pair only
(`UCX_TLS=tcp`, `UCX_NET_DEVICES=<veth>`). The proxy, the test and a colocated reference
instance stay in the root namespace and reach P and D over two more veth pairs, so
taking the P-D link down cuts only the KV path. Private /30s in 10.231.0.0/22, inside
namespaces this test creates and deletes (`netns.two_hosts`). Needs root and iproute2.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest
from netns import TwoHosts, ip, require_netns, two_hosts, unread_in_netns
from pd_faults import (
    Expected,
    complete,
    connector,
    fault_spec,
    in_background,
    prompt_of,
    run_stream,
    running_cluster,
    wait_for,
)

from kvlink.bench.cluster import Cluster
from kvlink.bench.instance_state import wait_clean

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]

NUM_BLOCKS, LEASE_S, STALL_S, SLACK_S = 64, 4.0, 2.0, 4.0
TAG = f"{os.getpid() % 100000}"


@pytest.fixture(scope="module")
def hosts() -> Iterator[TwoHosts]:
    require_netns(TAG, skip_outside_ci=True)
    with two_hosts(TAG, octet=231) as made:
        yield made


@pytest.fixture(scope="module")
def cluster(hosts: TwoHosts) -> Iterator[Cluster]:
    config = fault_spec(num_blocks=NUM_BLOCKS, lease_s=LEASE_S, stall_timeout_s=STALL_S,
                        quarantine_s=1.0, prefill_host=hosts.p_addr, decode_host=hosts.d_http_addr,
                        prefill_netns=hosts.ns_p, decode_netns=hosts.ns_d, env={"UCX_TLS": "tcp"},
                        # Each side's UCX uses only its end of the P-D link.
                        prefill_env={"UCX_NET_DEVICES": hosts.link_p},
                        decode_env={"UCX_NET_DEVICES": hosts.link_d})
    yield from running_cluster(config, "kvlink-partition", timeout_s=180)


def _urls(c: Cluster) -> tuple[str, str, str]:
    assert c.proxy is not None and c.prefill is not None and c.decode is not None
    return c.proxy.url, c.prefill.url, c.decode.url


def test_link_down_mid_transfer_then_back(cluster: Cluster, hosts: TwoHosts) -> None:
    assert cluster.colocated is not None
    expected = Expected(cluster.colocated.url)
    proxy, p_url, d_url = _urls(cluster)
    run_stream(proxy, range(0, 4), expected)
    assert cluster.member("prefill").engine_id in connector(cluster, "decode")["remote_engines"]

    # D frozen while P prefills; the link goes down; D wakes and posts its READ into the void.
    cluster.signal("decode", signal.SIGSTOP)
    try:
        join = in_background(lambda: complete(proxy, prompt_of(50), 8, STALL_S + 3 * SLACK_S))
        wait_for(lambda: connector(cluster, "prefill")["leases"] >= 1, 20, "P holding the request")
        wait_for(lambda: unread_in_netns(hosts.ns_d, cluster.member("decode").port) > 0, 20, "request waiting at D")
        ip("link", "set", hosts.link_d, "down", netns=hosts.ns_d)
        cut = time.monotonic()
    finally:
        cluster.signal("decode", signal.SIGCONT)
    try:
        result = join(STALL_S + 3 * SLACK_S)
        print(f"partitioned request answered {time.monotonic() - cut:.2f}s after the cut")
        # Policy recompute: D prefills locally once the stall deadline fires; same text.
        assert result.status == 200 and result.text == expected(prompt_of(50), 8), result
        assert time.monotonic() - cut < STALL_S + SLACK_S
        wait_clean([d_url], NUM_BLOCKS, 5)
        # P never hears from D: it frees on lease expiry.
        took = wait_clean([p_url], NUM_BLOCKS, LEASE_S + SLACK_S)
        print(f"P clean {took[p_url]:.2f}s after the answer (lease {LEASE_S}s)")
        # More requests while partitioned: each stalls and is recomputed, never wrong.
        during = complete(proxy, prompt_of(51), 8, STALL_S + 3 * SLACK_S)
        assert during.status == 200 and during.text == expected(prompt_of(51), 8), during
    finally:
        ip("link", "set", hosts.link_d, "up", netns=hosts.ns_d)
    healed = time.monotonic()
    # After the link is back the same engines serve normally again (UCX's TCP connection
    # survives a short cut; if it did not, the first request recomputes and D re-handshakes).
    results = run_stream(proxy, range(60, 66), expected, timeout_s=STALL_S + 3 * SLACK_S)
    print("after healing: " + ", ".join(f"{r.elapsed_s:.2f}s" for r in results)
          + f" ({time.monotonic() - healed:.1f}s for the six)")
    assert max(r.elapsed_s for r in results[2:]) < STALL_S, "still stalling after the link came back"
    wait_clean([p_url, d_url], NUM_BLOCKS, LEASE_S + SLACK_S)
