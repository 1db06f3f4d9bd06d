"""Two hosts: P and D in two network namespaces, the KV over a veth pair, the router in the root one.

UCX is held to TCP on the P-D link only (`UCX_TLS=tcp`, `UCX_NET_DEVICES=<veth end>`):
no shared-memory or CMA path exists between real hosts, and CMA would cross namespaces
if allowed. Answers through kvlink's proxy and through vllm-router must equal the
colocated reference's, every load must arrive through the connector (D fails instead of
recomputing), and the KV bytes must be seen crossing the link; `kvlink bench transfer`
places its two worker processes there too. Runs in `make test` (25-55 s as root on a
busy 2-core VM); it fails in CI (env CI=true) when namespaces cannot be made, and skips
with the reason elsewhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from netns import TwoHosts, link_bytes, require_netns, two_hosts
from pd_faults import Expected, complete, fault_spec, metric, prompt_of, run_stream, running_cluster

from kvlink.bench.cluster import Cluster
from kvlink.bench.instance_state import wait_clean
from kvlink.bench.routers import router_argv
from kvlink.procs.launcher import free_port, start_process, stop_all, wait_healthy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

NUM_BLOCKS = 64
TAG = f"{os.getpid() % 100000}"


@pytest.fixture(scope="module")
def hosts() -> Iterator[TwoHosts]:
    require_netns(TAG, skip_outside_ci=True)
    with two_hosts(TAG, octet=232) as made:
        yield made


def test_bench_transfer_across_hosts(hosts: TwoHosts, tmp_path: Path) -> None:
    """`kvlink bench transfer` with P's and D's workers in the two namespaces: the pages arrive
    intact, and UCX reads over TCP on D's end of the P-D link (run first: no cluster yet)."""
    out = tmp_path / "t.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvlink.cli.main", "bench", "transfer", "--preset", "smollm2-135m",
         "--tokens", "32,100", "--repeats", "3", "--min-seconds", "0", "--json", str(out),
         "--p-netns", hosts.ns_p, "--p-host", hosts.p_addr, "--d-netns", hosts.ns_d, "--d-host", hosts.d_addr],
        env={**os.environ, "UCX_TLS": "tcp"}, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert f"via tcp/{hosts.link_d}" in result["ucx_get_protocol"], result["ucx_get_protocol"]
    assert [row["verified_pages"] for row in result["rows"]] == [16] * 4


@pytest.fixture(scope="module")
def cluster(hosts: TwoHosts) -> Iterator[Cluster]:
    config = fault_spec(num_blocks=NUM_BLOCKS, load_failure_policy="fail",
                        prefill_host=hosts.p_addr, decode_host=hosts.d_http_addr,
                        prefill_netns=hosts.ns_p, decode_netns=hosts.ns_d, env={"UCX_TLS": "tcp"},
                        prefill_env={"UCX_NET_DEVICES": hosts.link_p},
                        decode_env={"UCX_NET_DEVICES": hosts.link_d})
    yield from running_cluster(config, "kvlink-two-hosts", timeout_s=180)


def test_answers_across_hosts_equal_colocated(cluster: Cluster, hosts: TwoHosts, expected: Expected) -> None:
    assert cluster.proxy is not None and cluster.decode is not None and cluster.prefill is not None
    d_url = cluster.decode.url
    moved_before, link_before = metric(d_url, "kvlink_bytes_total"), link_bytes(hosts)
    transfers_before = metric(d_url, "kvlink_transfers_total")
    results = run_stream(cluster.proxy.url, range(0, 8), expected)
    moved = metric(d_url, "kvlink_bytes_total") - moved_before
    crossed = link_bytes(hosts) - link_before
    print(f"8 requests across hosts: {moved / 2**20:.2f} MiB of KV loaded, {crossed / 2**20:.2f} MiB "
          f"received on D's end of the P-D link; " + ", ".join(f"{r.elapsed_s:.2f}s" for r in results))
    assert metric(d_url, "kvlink_transfers_total") - transfers_before >= 8, "a request did not load through the connector"
    assert metric(d_url, "kvlink_failed_transfers_total") == 0
    assert moved > 0 and crossed >= moved, (
        f"D loaded {moved} bytes of KV but its end of the P-D link received only {crossed}: "
        "the KV took another path than the veth pair")
    wait_clean([cluster.prefill.url, d_url], NUM_BLOCKS, 10)


def test_long_prompt_across_hosts(cluster: Cluster, expected: Expected) -> None:
    """A prompt of many blocks (hundreds of tokens) and a longer answer, same text as colocated."""
    assert cluster.proxy is not None
    prompt = " ".join(prompt_of(i) for i in range(40, 44))
    result = complete(cluster.proxy.url, prompt, 24, 60)
    assert result.status == 200 and result.text == expected(prompt, 24), result


def test_vllm_router_across_hosts(cluster: Cluster, expected: Expected, tmp_path: Path) -> None:
    """vllm-router in the root namespace, in front of the same P and D: the same answers."""
    port = free_port()
    argv = router_argv("vllm-router", [m.url for m in cluster.roles("prefill")],
                       [m.url for m in cluster.roles("decode")], port, 60.0)
    # Its metrics listener defaults to port 29000, which another router on this machine may hold.
    argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    router = start_process("vllm-router", argv, f"http://127.0.0.1:{port}", tmp_path)
    try:
        wait_healthy([router], 60)
        run_stream(router.url, range(10, 14), expected)
    finally:
        stop_all([router], 10)
