"""Forged `kv_transfer_params` against live servers whose P and D share a secret (as every
`Cluster` deployment does).

A client that reaches D directly sends params P did not make for it: another request's
block ids, another engine id, other fields altered, the signature stripped or made with
another secret, params past their expiry, params an earlier start of P made. D answers
403 and reads nothing: D moves no KV bytes, and the request whose blocks were aimed at
keeps its lease on P and loads normally afterwards. Through the proxy, which forwards
only what P returned, everything works.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvlink.bench.cluster import Cluster, ClusterSpec
from kvlink.bench.instance_state import metric
from kvlink.connector.params import sign
from kvlink.connector.secret import new_secret

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
NUM_BLOCKS = 64
LEASE_S = 60.0  # longer than a restart of P, so old params are refused for the restart alone
VICTIM = "A secret about the victim's account number " * 3
ATTACKER = "The attacker asks an innocent question " * 3


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(ClusterSpec(model="tiny-hybrid", num_blocks=NUM_BLOCKS, lease_s=LEASE_S, request_timeout_s=60.0),
                Path(tempfile.gettempdir()) / f"kvlink-forged-{os.getpid()}")
    c.start()
    try:
        yield c
    finally:
        c.stop()


def _url(c: Cluster, which: str) -> str:
    svc = getattr(c, which)
    assert svc is not None
    return str(svc.url)


def _complete(url: str, prompt: str, params: dict[str, Any] | None = None, max_tokens: int = 4) -> httpx.Response:
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if params is not None:
        body["kv_transfer_params"] = params
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def _held(c: Cluster, prompt: str) -> dict[str, Any]:
    """What P answers a router: it prefilled `prompt` and holds its blocks under a lease."""
    r = _complete(_url(c, "prefill"), prompt, {"do_remote_decode": True}, max_tokens=1)
    assert r.status_code == 200, r.text
    params: dict[str, Any] = r.json()["kv_transfer_params"]
    return params


def _read_by_d(c: Cluster) -> tuple[float, float]:
    d_url = _url(c, "decode")
    return metric(d_url, "kvlink_transfers_total"), metric(d_url, "kvlink_bytes_total")


def _assert_forbidden(r: httpx.Response, needle: str) -> None:
    assert r.status_code == 403, f"HTTP {r.status_code}: {r.text[:300]}"
    error = r.json()["error"]
    assert error["type"] == "permission_error" and error["code"] == "forbidden_kv_transfer_params"
    assert needle in error["message"], error["message"]


def _leases(c: Cluster) -> int:
    return int(c.state("prefill")["engine"]["connector"]["leases"])


def test_the_proxy_forwards_signed_params_and_d_loads_them(cluster: Cluster) -> None:
    params = _held(cluster, ATTACKER + " warm-up")
    assert params["kv_signature"] and params["kv_expires_at_ms"] > time.time() * 1000
    r = _complete(_url(cluster, "proxy"), "Routers only forward what P returned", max_tokens=6)
    assert r.status_code == 200, r.text
    assert r.json()["kvlink"]["kv_bytes"] > 0  # D read the KV from P
    # The warm-up params are P's own: D takes them as they are.
    assert _complete(_url(cluster, "decode"), ATTACKER + " warm-up", params).status_code == 200


def test_forged_params_get_403_and_nothing_is_read(cluster: Cluster) -> None:
    d_url = _url(cluster, "decode")
    victim, own = _held(cluster, VICTIM), _held(cluster, ATTACKER)
    assert victim["remote_block_ids"] != own["remote_block_ids"]
    leases, read_before = _leases(cluster), _read_by_d(cluster)
    other_secret = new_secret().encode()
    unsigned = {k: v for k, v in own.items() if k != "kv_signature"}
    forgeries: list[tuple[str, dict[str, Any], str]] = [
        ("another request's block ids", {**own, "remote_block_ids": victim["remote_block_ids"]},
         "kv_signature does not match"),
        ("another request's id and blocks", {**own, "remote_request_id": victim["remote_request_id"],
                                             "remote_block_ids": victim["remote_block_ids"]},
         "kv_signature does not match"),
        ("another engine id", {**own, "remote_engine_id": cluster.member("prefill").engine_id + "-other"},
         "kv_signature does not match"),
        ("the victim's params bound to the attacker's prompt",
         {**victim, "prompt_hash": own["prompt_hash"]}, "kv_signature does not match"),
        ("a lease that never ends", {**own, "kv_expires_at_ms": own["kv_expires_at_ms"] + 10**9},
         "kv_signature does not match"),
        ("another port", {**own, "remote_port": own["remote_port"] + 1}, "kv_signature does not match"),
        ("signature stripped", unsigned, "no kv_signature"),
        ("signed with another secret", {**unsigned, "kv_signature": sign(unsigned, other_secret)},
         "kv_signature does not match"),
        ("the victim's blocks, signed with another secret",
         {**unsigned, "remote_block_ids": victim["remote_block_ids"],
          "kv_signature": sign({**unsigned, "remote_block_ids": victim["remote_block_ids"]}, other_secret)},
         "kv_signature does not match"),
    ]
    for name, params, needle in forgeries:
        r = _complete(d_url, ATTACKER, params)
        try:
            _assert_forbidden(r, needle)
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from None
    assert _read_by_d(cluster) == read_before, "D read KV with forged params"
    assert _leases(cluster) == leases, "a forged request freed or took a lease on P"
    # The victim's blocks were neither read nor freed: its own params still load them.
    for prompt, params in ((VICTIM, victim), (ATTACKER, own)):
        r = _complete(d_url, prompt, params)
        assert r.status_code == 200, r.text
        assert r.json()["kvlink"]["kv_bytes"] > 0


def test_params_from_an_earlier_start_of_p_get_403(cluster: Cluster) -> None:
    d_url = _url(cluster, "decode")
    assert _complete(_url(cluster, "proxy"), "D knows this P", max_tokens=2).status_code == 200
    old = _held(cluster, VICTIM + " before the restart")
    cluster.restart("prefill")  # same engine id, port and secret; fresh memory
    read_before, restarted_before = _read_by_d(cluster), metric(d_url, "restarted_peer_loads_total")
    r = _complete(d_url, VICTIM + " before the restart", old)
    _assert_forbidden(r, "restarted after prefilling")
    assert _read_by_d(cluster) == read_before
    assert metric(d_url, "restarted_peer_loads_total") == restarted_before + 1
    r = _complete(_url(cluster, "proxy"), VICTIM + " after the restart", max_tokens=2)
    assert r.status_code == 200 and r.json()["kvlink"]["kv_bytes"] > 0, r.text


def test_expired_params_get_403(cluster: Cluster) -> None:
    short_lease_s = 2.0
    try:
        cluster.restart("prefill", extra_args=["--lease-s", str(short_lease_s)])
        params = _held(cluster, VICTIM + " expiring")
        time.sleep(max(0.0, params["kv_expires_at_ms"] / 1000 - time.time()) + 0.5)
        read_before = _read_by_d(cluster)
        _assert_forbidden(_complete(_url(cluster, "decode"), VICTIM + " expiring", params), "expired")
        assert _read_by_d(cluster) == read_before
    finally:
        cluster.restart("prefill", extra_args=[])
    assert _complete(_url(cluster, "proxy"), "fine again", max_tokens=2).status_code == 200
