"""Bad input against live `kvlink serve` processes (tiny-hybrid P and D, and the proxy).

* HTTP bodies and kv_transfer_params of wrong types, missing fields, huge or negative
  block ids, another request's blocks, unknown engines: a 4xx naming the problem, the
  server stays up, and a request streaming on the same server meanwhile is unaffected.
  (Params the test re-signs with the cluster's secret reach D's load path; forgeries are
  in test_forged_params.py.)
* P's side channel gets truncated, oversized, unsigned, wrong-version, wrong-typed and
  random frames: each is refused and counted, and P keeps serving handshakes and requests.
* A raw NIXL agent that loaded P's metadata from its handshake sends unsigned garbage and
  signed notifications for unknown requests: dropped and counted, no lease changes.
* The statuses a router acts on (docs/serving.md, "Errors"): an unknown model is 404
  `model_not_found` on P, D and the proxy; a prompt over the context is 400; params naming a
  P nobody listens for (P dead) are a retryable 502 `kv_load_failed` from D.
* Everything listens on 127.0.0.1 by default.
"""

from __future__ import annotations

import os
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from forge import resigned
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlink.bench.cluster import Cluster, ClusterSpec
from kvlink.bench.instance_state import metric, wait_clean
from kvlink.connector.notifs import Done, Heartbeat, encode
from kvlink.procs.launcher import free_port, start_service, stop_all, wait_healthy
from kvlink.transfer.agent import NixlAgent
from kvlink.transfer.framing import pack_frame
from kvlink.transfer.side_channel import fetch_payload
from kvlink.transfer.wire import PROTOCOL_VERSION

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
NUM_BLOCKS = 64
PROMPT = "The quick brown fox " * 6
HELD_PROMPT = PROMPT + " held"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(ClusterSpec(model="tiny-hybrid", num_blocks=NUM_BLOCKS, lease_s=30.0, request_timeout_s=60.0),
                Path(tempfile.gettempdir()) / f"kvlink-badinput-{os.getpid()}")
    c.start()
    try:
        yield c
    finally:
        c.stop()


def _urls(c: Cluster) -> tuple[str, str, str]:
    assert c.proxy is not None and c.prefill is not None and c.decode is not None
    return c.proxy.url, c.prefill.url, c.decode.url


def _complete(url: str, body: dict[str, Any], timeout_s: float = 30) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=timeout_s)


class Streaming:
    """A long streaming request through the proxy, read in a thread while we misbehave."""

    def __init__(self, proxy: str, max_tokens: int = 120) -> None:
        self.text: list[str] = []
        self.error: str | None = None
        self.body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        self._thread = threading.Thread(target=self._run, args=(proxy,), daemon=True)
        self._thread.start()

    def _run(self, proxy: str) -> None:
        import json

        try:
            with httpx.stream("POST", proxy + "/v1/completions", json=self.body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        event = json.loads(line[6:])
                        if "error" in event:
                            self.error = str(event["error"])
                        else:
                            self.text.append(event["choices"][0]["text"])
        except httpx.HTTPError as error:
            self.error = repr(error)

    def result(self, timeout_s: float = 60) -> str:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the in-flight request did not finish"
        assert self.error is None, self.error
        return "".join(self.text)


def _expected_text(proxy: str, max_tokens: int) -> str:
    r = _complete(proxy, {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def _held_params(p_url: str) -> dict[str, Any]:
    """Ask P directly to prefill for a remote decoder: it holds the blocks under a lease."""
    r = _complete(p_url, {"prompt": HELD_PROMPT, "max_tokens": 1, "temperature": 0,
                          "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    params: dict[str, Any] = r.json()["kv_transfer_params"]
    return params


def test_bad_http_bodies_and_params_get_4xx_while_a_stream_runs(cluster: Cluster) -> None:
    proxy, p_url, d_url = _urls(cluster)
    want = _expected_text(proxy, 120)
    stream = Streaming(proxy)
    good = _held_params(p_url)  # made for PROMPT + " held"
    cases: list[tuple[str, str, Any, str]] = [
        ("not JSON", proxy, b"{oops", "JSON"),
        ("array body", d_url, [1, 2], ""),
        ("prompt wrong type", d_url, {"prompt": {"a": 1}}, "prompt"),
        ("max_tokens string", d_url, {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ("max_tokens negative", proxy, {"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ("temperature huge", proxy, {"prompt": "x", "temperature": 1e9}, "temperature"),
        ("token id out of vocab", d_url, {"prompt": [10**9]}, "token ids must be in"),
        ("params not an object", d_url, {"prompt": "x", "kv_transfer_params": [1]}, "kv_transfer_params"),
        ("params missing fields", d_url, {"prompt": "x", "kv_transfer_params": {"do_remote_prefill": True}},
         "remote_engine_id"),
        ("negative block id", d_url, {"prompt": HELD_PROMPT, "kv_transfer_params":
                                      {**good, "remote_block_ids": [[-1]]}}, "invalid block ids"),
        ("huge block id", d_url, {"prompt": HELD_PROMPT, "kv_transfer_params": resigned(
            good, cluster.secret, remote_block_ids=[[2**39, 2**39 + 1], [5]])}, "block"),
        ("block id past P's pool", d_url, {"prompt": HELD_PROMPT, "kv_transfer_params": resigned(
            good, cluster.secret, remote_block_ids=[[NUM_BLOCKS + 3], [1]])}, "block"),
        ("params of another prompt", d_url, {"prompt": PROMPT + " other", "kv_transfer_params": good},
         "another prompt"),
        ("unknown engine id", d_url, {"prompt": HELD_PROMPT, "kv_transfer_params":
                                      resigned(good, cluster.secret, remote_engine_id="nobody")}, "nobody"),
        ("altered params", d_url, {"prompt": HELD_PROMPT, "kv_transfer_params":
                                   {**good, "remote_engine_id": "nobody"}}, "kv_signature does not match"),
        ("do_remote_decode not a bool", p_url, {"prompt": "x", "kv_transfer_params": {"do_remote_decode": 7}},
         "do_remote_decode"),
        ("do_remote_prefill not a bool", d_url, {"prompt": "x", "kv_transfer_params": {"do_remote_prefill": "y"}},
         "do_remote_prefill"),
    ]
    for name, url, body, needle in cases:
        if isinstance(body, bytes):
            r = httpx.post(url + "/v1/completions", content=body, timeout=30)
        else:
            r = httpx.post(url + "/v1/completions", json=body if not isinstance(body, dict)
                           else {"max_tokens": 2, "temperature": 0, **body}, timeout=30)
        assert 400 <= r.status_code < 500, f"{name}: HTTP {r.status_code} {r.text[:300]}"
        message = r.json()["error"]["message"]
        assert needle.lower() in message.lower(), f"{name}: {message!r} does not mention {needle!r}"
    # The stream that ran meanwhile on the same instances is unaffected, and the held
    # request survived every refusal that named it.
    assert stream.result() == want
    assert cluster.state("prefill")["engine"]["connector"]["leases"] >= 1
    r = _complete(d_url, {"prompt": HELD_PROMPT, "max_tokens": 8, "temperature": 0,
                          "kv_transfer_params": good})
    plain = _complete(proxy, {"prompt": HELD_PROMPT, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(
    st.sampled_from(["prompt", "max_tokens", "temperature", "top_p", "stream", "stop", "seed", "n",
                     "kv_transfer_params", "logprobs"]),
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20) | st.lists(st.integers(-5, 10**6), max_size=5)
    | st.dictionaries(st.text(max_size=10), st.integers() | st.text(max_size=5), max_size=4),
    max_size=6))
def test_random_bodies_never_5xx(cluster: Cluster, body: dict[str, Any]) -> None:
    _, _, d_url = _urls(cluster)
    r = httpx.post(d_url + "/v1/completions", json={"max_tokens": 2, **body}, timeout=30)
    assert r.status_code < 500, f"{body}: HTTP {r.status_code} {r.text[:300]}"
    if r.status_code >= 400:
        assert r.json()["error"]["message"]


def test_statuses_a_router_acts_on(cluster: Cluster) -> None:
    proxy, p_url, d_url = _urls(cluster)
    served = httpx.get(d_url + "/v1/models", timeout=10).json()["data"][0]["id"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for url in (p_url, d_url, proxy):
        for route, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": True}),
                            ("/v1/chat/completions", chat)):
            r = httpx.post(url + route, json={**body, "model": "gpt-4o"}, timeout=30)
            assert r.status_code == 404, f"{url}{route}: HTTP {r.status_code} {r.text[:300]}"
            error = r.json()["error"]
            assert (error["code"], error["param"]) == ("model_not_found", "model"), error
            assert served in error["message"]
    assert _complete(proxy, {"prompt": "named", "max_tokens": 2, "model": served}).status_code == 200
    for url in (d_url, proxy):
        r = httpx.post(url + "/v1/embeddings", json={"input": "x"}, timeout=10)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text
    too_long = {"prompt": [1] * 4096, "max_tokens": 2}
    for url in (d_url, proxy):
        r = _complete(url, too_long)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    # P gone after answering: D cannot reach it. Not the client's fault, so not a 4xx.
    good = _held_params(p_url)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]
    gone = resigned(good, cluster.secret, remote_engine_id="gone-p", remote_port=closed_port)
    r = _complete(d_url, {"prompt": HELD_PROMPT, "max_tokens": 2, "temperature": 0, "kv_transfer_params": gone})
    assert r.status_code == 502, f"HTTP {r.status_code} {r.text[:300]}"
    error = r.json()["error"]
    assert error["code"] == "kv_load_failed" and "Connection refused" in error["message"], error
    # The held request is intact and loads from the real P.
    r = _complete(d_url, {"prompt": HELD_PROMPT, "max_tokens": 2, "temperature": 0, "kv_transfer_params": good})
    assert r.status_code == 200, r.text


def _p_holds(p_url: str) -> int:
    """Requests P's engine holds for decoders now (read on its engine thread)."""
    return int(httpx.get(p_url + "/debug/state", timeout=10).json()["engine"]["held_requests"])


def test_p_frees_at_once_the_params_a_router_hands_back(cluster: Cluster) -> None:
    """`POST /v1/kv_release` on P with the params it answered with frees their blocks now
    (a router whose decode leg never reached D), not when the lease ends; params it did not
    sign, or not its own, are refused and free nothing; other instances have no such route."""
    _, p_url, d_url = _urls(cluster)
    held = _complete(p_url, {"prompt": "handed back " * 5, "max_tokens": 1, "temperature": 0,
                             "kv_transfer_params": {"do_remote_decode": True}}).json()["kv_transfer_params"]
    before = _p_holds(p_url)
    assert before >= 1
    handed_back = metric(p_url, "kv_params_handed_back_total", 'outcome="released"')

    def release(body: Any) -> httpx.Response:
        return httpx.post(p_url + "/v1/kv_release", json=body, timeout=10)

    for forged, status in ((resigned(held, "another secret " * 3), 403),
                           ({**held, "remote_block_ids": [[0]] * len(held["remote_block_ids"])}, 403),
                           (resigned(held, cluster.secret, remote_engine_id="someone-else"), 403),
                           ({**held, "tp_size": "two"}, 400)):
        r = release({"kv_transfer_params": forged})
        assert r.status_code == status, r.text
    for junk in ([], {"kv_transfer_params": "x"}, {"other": 1}):
        assert release(junk).status_code == 400
    assert httpx.post(p_url + "/v1/kv_release", content=b"[" * 100_000, timeout=10).status_code == 400
    assert metric(p_url, "kv_params_handed_back_total", 'outcome="released"') == handed_back  # refusals free nothing
    r = release({"kv_transfer_params": held})
    assert r.status_code == 200 and r.json() == {"released": True}, r.text
    deadline = time.monotonic() + 10
    while _p_holds(p_url) >= before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _p_holds(p_url) <= before - 1  # (other tests' leases may end meanwhile, never begin)
    assert release({"kv_transfer_params": held}).json() == {"released": False}  # nothing held any more
    assert metric(p_url, "kv_params_handed_back_total", 'outcome="released"') == handed_back + 1
    r = httpx.post(d_url + "/v1/kv_release", json={"kv_transfer_params": held}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_a_prefill_instance"


def test_the_proxy_hands_params_back_when_its_decode_leg_never_reached_d(cluster: Cluster, tmp_path: Path) -> None:
    """A proxy whose decode instance is unreachable answers 502 `decode_unreachable` and
    hands P's params back: P frees the blocks at once, not after its 30 s lease."""
    _, p_url, _ = _urls(cluster)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = sock.getsockname()[1]
    port = free_port()
    proxy = start_service("proxy-dead-d", ["proxy", "--prefill", p_url, "--decode", f"http://127.0.0.1:{dead}",
                                           "--port", str(port)], port, tmp_path)
    try:
        wait_healthy([proxy], 30)
        before = _p_holds(p_url)
        released = metric(p_url, "kv_params_handed_back_total", 'outcome="released"')
        started = time.monotonic()
        r = _complete(proxy.url, {"prompt": "nobody decodes this " * 3, "max_tokens": 4, "temperature": 0})
        assert r.status_code == 502 and r.json()["error"]["code"] == "decode_unreachable", r.text
        while metric(proxy.url, "params_handed_back_total", 'outcome="released"') < 1 \
                and time.monotonic() - started < 10:
            time.sleep(0.1)
        # P freed this request's blocks (it said so), well inside its 30 s lease
        assert metric(proxy.url, "params_handed_back_total", 'outcome="released"') == 1
        assert metric(p_url, "kv_params_handed_back_total", 'outcome="released"') == released + 1
        assert _p_holds(p_url) <= before
        assert time.monotonic() - started < 10
    finally:
        stop_all([proxy])


def test_d_clean_after_bad_input(cluster: Cluster) -> None:
    proxy, _, d_url = _urls(cluster)
    wait_clean([d_url], NUM_BLOCKS, 10)
    assert _complete(proxy, {"prompt": "still fine?", "max_tokens": 4}).status_code == 200


# ---- P's side channel ---------------------------------------------------------------------
def _send_raw(port: int, data: bytes, read: bool = True) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(data)
        if not read:
            return b""
        sock.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def test_side_channel_refuses_and_counts_garbage_and_keeps_serving(cluster: Cluster) -> None:
    proxy, p_url, _ = _urls(cluster)
    prefill = cluster.member("prefill")
    port, engine_id = prefill.kv_port, prefill.engine_id
    before = metric(p_url, "rejected_handshakes_total")
    unauthenticated_before = metric(p_url, "unauthenticated_handshakes_total")
    enc = msgspec.msgpack.encode
    secret = cluster.secret.encode()

    def _frame(body: bytes) -> bytes:  # signed: it gets past the HMAC check to the decoder
        return pack_frame(body, secret)

    request = enc({"type": "request", "version": PROTOCOL_VERSION, "engine_id": engine_id, "tp_rank": 0})
    garbage = [
        struct.pack(">I", len(request)) + request,  # a good request from a D without the secret
        struct.pack(">I", 16) + b"x" * 16,  # too short to carry an HMAC
        struct.pack(">I", 100) + b"short",  # truncated
        struct.pack(">I", 2**31),  # oversized length
        _frame(enc({"type": "request", "version": 99, "engine_id": engine_id, "tp_rank": 0})),
        _frame(enc({"type": "request", "version": PROTOCOL_VERSION, "engine_id": 5, "tp_rank": "0"})),
        _frame(enc({"type": "request", "version": PROTOCOL_VERSION})),  # missing fields
        _frame(os.urandom(64)),
        os.urandom(3),
        _frame(enc({"type": "request", "version": PROTOCOL_VERSION, "engine_id": "other", "tp_rank": 0})),
        _frame(enc({"type": "request", "version": PROTOCOL_VERSION, "engine_id": engine_id,
                    "tp_rank": 7})),
    ]
    for data in garbage:
        reply = _send_raw(port, data)
        assert b"agent_metadata" not in reply  # never a payload for a bad request
    # Still serving: a proper handshake and a request through the proxy.
    payload = fetch_payload("127.0.0.1", port, engine_id, 0, 5.0, secret=secret)
    assert payload.engine_id == engine_id
    assert _complete(proxy, {"prompt": "after garbage", "max_tokens": 4}).status_code == 200
    deadline = time.monotonic() + 10
    while metric(p_url, "rejected_handshakes_total") < before + len(garbage):
        assert time.monotonic() < deadline, metric(p_url, "rejected_handshakes_total")
        _complete(proxy, {"prompt": "tick", "max_tokens": 1})  # the counters refresh on steps
        time.sleep(0.5)
    assert metric(p_url, "unauthenticated_handshakes_total") == unauthenticated_before + 2


# ---- NIXL notifications from a raw agent ----------------------------------------------------
def test_raw_agent_notifications_are_dropped_without_touching_leases(cluster: Cluster) -> None:
    proxy, p_url, d_url = _urls(cluster)
    held = _held_params(p_url)
    leases_before = cluster.state("prefill")["engine"]["connector"]["leases"]
    secret = cluster.secret.encode()
    prefill = cluster.member("prefill")
    payload = fetch_payload("127.0.0.1", prefill.kv_port, prefill.engine_id, 0, 5.0, secret=secret)
    agent = NixlAgent(f"intruder-{os.getpid()}")
    try:
        name = agent.add_remote(payload.agent_metadata)
        bad_before = metric(p_url, "unauthenticated_notifications_total")
        garbage = [b"", os.urandom(40), b"kvlink1:done:0:x", b"kvlink1:hb:1:{", b"kvlink9:done:1:x",
                   encode(Done(held["remote_request_id"], 1))]  # unsigned: must not free the held one
        for raw in garbage:
            agent.send_notif(name, raw)
        for raw in (encode(Done("no-such-request", 1), secret), encode(Heartbeat(("no-such-request",)), secret)):
            agent.send_notif(name, raw)
        deadline = time.monotonic() + 10
        while metric(p_url, "unauthenticated_notifications_total") < bad_before + len(garbage):
            assert time.monotonic() < deadline, "garbage notifications not counted"
            agent.get_notifs()
            _complete(proxy, {"prompt": "tick", "max_tokens": 1})
            time.sleep(0.2)
        assert cluster.state("prefill")["engine"]["connector"]["leases"] >= leases_before
        # The held request is intact: D loads it and answers.
        r = _complete(d_url, {"prompt": HELD_PROMPT, "max_tokens": 3, "temperature": 0,
                              "kv_transfer_params": held})
        assert r.status_code == 200, r.text
    finally:
        agent.close()


def test_everything_listens_on_loopback_by_default(cluster: Cluster) -> None:
    for svc in (cluster.prefill, cluster.decode, cluster.proxy):
        assert svc is not None
        listening = _listening_addresses(svc.proc.pid)
        assert listening, f"{svc.name}: no listening sockets found"
        public = [a for a in listening if not a.startswith("127.")]
        assert not public, f"{svc.name} listens on {public}"


def _listening_addresses(pid: int) -> list[str]:
    """IPv4/IPv6 TCP sockets in LISTEN state owned by `pid`, as 'addr:port'."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:
                continue
            addr_hex, port_hex = fields[1].split(":")
            if width == 8:
                addr = socket.inet_ntop(socket.AF_INET, bytes.fromhex(addr_hex)[::-1])
            else:
                raw = bytes.fromhex(addr_hex)
                addr = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
            found.append(f"{addr}:{int(port_hex, 16)}")
    return found
