"""Network partition between P and D: two network namespaces joined by a veth pair.

P runs in one namespace and D in another; UCX uses TCP over the veth pair only
(`UCX_TLS=tcp`, `UCX_NET_DEVICES=<veth>`). The proxy, the test and a colocated reference
instance stay in the root namespace and reach P and D over two more veth pairs, so
taking the P-D link down cuts only the KV path. Private /30s in 10.231.0.0/22, inside
namespaces this test creates and deletes. Needs root and iproute2 (`ip netns`).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator

import pytest
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
NS_P, NS_D = f"kvp{TAG}", f"kvd{TAG}"
KV_P, KV_D = f"kvkp{TAG}", f"kvkd{TAG}"  # the P-D link (the one we cut)
HP_ROOT, HP_NS = f"kvhp{TAG}", f"kvhq{TAG}"  # root <-> P
HD_ROOT, HD_NS = f"kvhd{TAG}", f"kvhe{TAG}"  # root <-> D
P_KV_ADDR, D_KV_ADDR = "10.231.0.1", "10.231.0.2"
D_HTTP_ADDR = "10.231.2.2"


def _ip(*args: str, netns: str | None = None) -> None:
    command = ["ip", "netns", "exec", netns, "ip", *args] if netns else ["ip", *args]
    subprocess.run(command, check=True, capture_output=True, timeout=10)


def _netns_available() -> str | None:
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"kvprobe{TAG}"
    try:
        _ip("netns", "add", probe)
        _ip("netns", "del", probe)
    except subprocess.CalledProcessError as error:
        return f"`ip netns add` failed: {error.stderr.decode(errors='replace').strip()}"
    return None


@pytest.fixture(scope="module")
def topology() -> Iterator[None]:
    why = _netns_available()
    if why is not None:
        pytest.skip(why)
    try:
        for ns in (NS_P, NS_D):
            _ip("netns", "add", ns)
            _ip("link", "set", "lo", "up", netns=ns)
        _ip("link", "add", KV_P, "type", "veth", "peer", "name", KV_D)
        _ip("link", "add", HP_ROOT, "type", "veth", "peer", "name", HP_NS)
        _ip("link", "add", HD_ROOT, "type", "veth", "peer", "name", HD_NS)
        for dev, ns in ((KV_P, NS_P), (HP_NS, NS_P), (KV_D, NS_D), (HD_NS, NS_D)):
            _ip("link", "set", dev, "netns", ns)
        _ip("addr", "add", f"{P_KV_ADDR}/30", "dev", KV_P, netns=NS_P)
        _ip("addr", "add", f"{D_KV_ADDR}/30", "dev", KV_D, netns=NS_D)
        _ip("addr", "add", "10.231.1.2/30", "dev", HP_NS, netns=NS_P)
        _ip("addr", "add", f"{D_HTTP_ADDR}/30", "dev", HD_NS, netns=NS_D)
        _ip("addr", "add", "10.231.1.1/30", "dev", HP_ROOT)
        _ip("addr", "add", "10.231.2.1/30", "dev", HD_ROOT)
        for dev, ns in ((KV_P, NS_P), (HP_NS, NS_P), (KV_D, NS_D), (HD_NS, NS_D)):
            _ip("link", "set", dev, "up", netns=ns)
        for dev in (HP_ROOT, HD_ROOT):
            _ip("link", "set", dev, "up")
        # The root namespace reaches P's KV-link address (where P serves HTTP) through P's
        # root-facing veth; P owns that address, so nothing is forwarded.
        _ip("route", "add", f"{P_KV_ADDR}/32", "via", "10.231.1.2")
        yield
    finally:
        for dev in (HP_ROOT, HD_ROOT):
            subprocess.run(["ip", "link", "del", dev], capture_output=True, timeout=10)
        for ns in (NS_P, NS_D):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


@pytest.fixture(scope="module")
def cluster(topology: None) -> Iterator[Cluster]:
    config = fault_spec(num_blocks=NUM_BLOCKS, lease_s=LEASE_S, stall_timeout_s=STALL_S,
                        quarantine_s=1.0, prefill_host=P_KV_ADDR, decode_host=D_HTTP_ADDR,
                        prefill_netns=NS_P, decode_netns=NS_D, env={"UCX_TLS": "tcp"},
                        # Each side's UCX uses only its end of the P-D link.
                        prefill_env={"UCX_NET_DEVICES": KV_P}, decode_env={"UCX_NET_DEVICES": KV_D})
    yield from running_cluster(config, "kvlink-partition", timeout_s=180)


def _unread_in_netns(netns: str, port: int) -> int:
    out = subprocess.run(["ip", "netns", "exec", netns, "ss", "-tnH", "state", "established",
                          f"( sport = :{port} )"], capture_output=True, text=True, timeout=5,
                         check=True).stdout
    return sum(int(line.split()[0]) for line in out.splitlines() if line.strip())


def _urls(c: Cluster) -> tuple[str, str, str]:
    assert c.proxy is not None and c.prefill is not None and c.decode is not None
    return c.proxy.url, c.prefill.url, c.decode.url


def test_link_down_mid_transfer_then_back(cluster: Cluster) -> None:
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
        wait_for(lambda: _unread_in_netns(NS_D, cluster.member("decode").port) > 0, 20, "request waiting at D")
        _ip("link", "set", KV_D, "down", netns=NS_D)
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
        _ip("link", "set", KV_D, "up", netns=NS_D)
    healed = time.monotonic()
    # After the link is back the same engines serve normally again (UCX's TCP connection
    # survives a short cut; if it did not, the first request recomputes and D re-handshakes).
    results = run_stream(proxy, range(60, 66), expected, timeout_s=STALL_S + 3 * SLACK_S)
    print("after healing: " + ", ".join(f"{r.elapsed_s:.2f}s" for r in results)
          + f" ({time.monotonic() - healed:.1f}s for the six)")
    assert max(r.elapsed_s for r in results[2:]) < STALL_S, "still stalling after the link came back"
    wait_clean([p_url, d_url], NUM_BLOCKS, LEASE_S + SLACK_S)
