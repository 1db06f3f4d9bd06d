"""2 P + 2 D `kvlink serve` instances behind vllm-router (the pinned dev dependency).

Answers equal colocated under two policies; a killed P or D fails only the requests the
router sends before its health check takes the instance out, none after; a restarted P
takes traffic again; D's retryable errors reach the client; survivors hold nothing.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import httpx
import pytest
from e2e_helpers import NUM_BLOCKS, assert_clean, cluster_for, complete, spec

from kvlink.bench.cluster import Cluster
from kvlink.bench.instance_state import metric, wait_clean
from kvlink.bench.routers import vllm_router_flags

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

MAX_TOKENS = 4
# The failover settings docs/serving.md recommends: a health check every second that takes
# an instance out at its first failure; vllm-router's retries (on by default) stay on.
FAILOVER = {"health_check_interval_s": 1, "health_failure_threshold": 1}


@dataclass
class Answer:
    status: int | None  # None: the connection to the router itself failed
    body: str


def ask(url: str, prompt: str, max_tokens: int = MAX_TOKENS) -> Answer:
    """One greedy completion; vllm-router's own errors are plain text, so keep the body as text."""
    try:
        response = complete(url, prompt, max_tokens)
    except httpx.HTTPError as error:
        return Answer(None, repr(error))
    return Answer(response.status_code, response.text)


def text_of(answer: Answer) -> str:
    assert answer.status == 200, answer
    text: str = json.loads(answer.body)["choices"][0]["text"]
    return text


def prompt(i: int) -> str:
    words = ["amber", "delta", "pine", "orbit", "salt", "violet", "ember", "kite"]
    return f"note {i}: " + " ".join(words[(i * 3 + k) % len(words)] for k in range(6 + i % 40))


def health(router_url: str) -> dict[str, bool]:
    """vllm-router's view: instance URL -> is it in rotation."""
    workers = httpx.get(f"{router_url}/workers", timeout=5.0).json()["workers"]
    return {w["url"]: bool(w["is_healthy"]) for w in workers}


def wait_until(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what} not seen within {timeout_s:.0f}s"
        time.sleep(0.1)


def use_router(cluster: Cluster, policy: str) -> str:
    cluster.set_router_args(vllm_router_flags(policy, **FAILOVER))
    return cluster.restart("proxy").url


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    config = replace(spec("tiny-hybrid"), n_prefill=2, n_decode=2, router="vllm-router",
                     router_args=vllm_router_flags("round_robin", **FAILOVER))
    yield from cluster_for(config, tmp_path_factory, "vllm-router-2p-2d")


class Colocated(dict[str, str]):
    """The colocated instance's answer to a prompt, asked once."""

    def __init__(self, url: str) -> None:
        super().__init__()
        self.url = url

    def __missing__(self, key: str) -> str:
        self[key] = text_of(ask(self.url, key))
        return self[key]


@pytest.fixture(scope="module")
def expected(two_by_two: Cluster) -> Colocated:
    assert two_by_two.colocated is not None
    return Colocated(two_by_two.colocated.url)


def requests_served(cluster: Cluster, name: str) -> float:
    return metric(cluster.service(name).url, "requests_total")


@pytest.mark.parametrize("policy", ["round_robin", "cache_aware"])
def test_answers_equal_colocated(two_by_two: Cluster, expected: Colocated, policy: str) -> None:
    router = use_router(two_by_two, policy)
    before = {m.name: requests_served(two_by_two, m.name) for m in two_by_two.members if m.role != "both"}
    for i in range(8):
        assert text_of(ask(router, prompt(i))) == expected[prompt(i)], f"{policy}: prompt {i}"
    served = {name: requests_served(two_by_two, name) - n for name, n in before.items()}
    assert sum(served[m.name] for m in two_by_two.roles("prefill")) == 8, served
    assert sum(served[m.name] for m in two_by_two.roles("decode")) == 8, served
    if policy == "round_robin":
        assert all(n > 0 for n in served.values()), f"round_robin left an instance idle: {served}"
    assert_clean(two_by_two)


def test_killed_prefill_fails_only_until_the_health_check_and_comes_back(
        two_by_two: Cluster, expected: Colocated) -> None:
    router = use_router(two_by_two, "round_robin")
    victim = two_by_two.member("prefill1")
    outcomes: list[Answer] = []
    stop = threading.Event()

    def load() -> None:
        i = 100
        while not stop.is_set():
            outcomes.append(ask(router, prompt(i)))
            i += 1

    client = threading.Thread(target=load, daemon=True)
    client.start()
    try:
        wait_until(lambda: len(outcomes) >= 3, 60, "the load running")
        two_by_two.signal("prefill1", signal.SIGKILL)
        wait_until(lambda: not health(router)[victim.url], 30, "vllm-router taking the killed P out")
    finally:
        stop.set()
        client.join(70)
    assert not client.is_alive()
    for failed in (a for a in outcomes if a.status != 200):
        # An error, not a hang: the router's own 500 naming the dead P, or, for a request P
        # had prefilled before it died, D's 502 `kv_load_failed`.
        assert (failed.status == 500 and victim.url in failed.body) or (
            failed.status == 502 and json.loads(failed.body)["error"]["code"] == "kv_load_failed"), failed
    after = [ask(router, prompt(i)) for i in range(200, 206)]
    assert [text_of(a) for a in after] == [expected[prompt(i)] for i in range(200, 206)]
    wait_clean([m.url for m in two_by_two.members if m.name != "prefill1"], NUM_BLOCKS, 15)

    two_by_two.restart("prefill1")
    wait_until(lambda: health(router)[victim.url], 30, "vllm-router taking the restarted P back")
    for i in range(300, 306):
        assert text_of(ask(router, prompt(i))) == expected[prompt(i)]
    assert requests_served(two_by_two, "prefill1") > 0, "the restarted P got no traffic"
    assert_clean(two_by_two)


def test_decode_retryable_error_reaches_the_client(two_by_two: Cluster) -> None:
    """P dies after its prefill, before D reads: D's 502 `kv_load_failed` comes through the
    router as it is (vllm-router 0.1.17 does not retry on D's answer), so a client can retry."""
    router = use_router(two_by_two, "round_robin")
    decodes = [m.name for m in two_by_two.roles("decode")]
    for name in decodes:
        two_by_two.signal(name, signal.SIGSTOP)
    box: list[Answer] = []
    try:
        client = threading.Thread(target=lambda: box.append(ask(router, prompt(400))), daemon=True)
        client.start()

        def holder() -> str | None:
            for m in two_by_two.roles("prefill"):
                if two_by_two.state(m.name)["engine"]["connector"]["leases"]:
                    return m.name
            return None

        wait_until(lambda: holder() is not None, 30, "a P holding the prefilled request")
        victim = holder()
        assert victim is not None
        two_by_two.signal(victim, signal.SIGKILL)
    finally:
        for name in decodes:
            two_by_two.signal(name, signal.SIGCONT)
    client.join(60)
    assert box, "the client is still waiting"
    assert box[0].status == 502, box[0]
    assert json.loads(box[0].body)["error"]["code"] == "kv_load_failed", box[0]
    wait_clean([m.url for m in two_by_two.members if m.name != victim], NUM_BLOCKS, 15)
    two_by_two.restart(victim)
    wait_until(lambda: all(health(router).values()), 30, "every instance back in rotation")


def test_killed_decode_ends_its_requests_with_an_error_and_the_other_takes_new_ones(
        two_by_two: Cluster, expected: Colocated) -> None:
    router = use_router(two_by_two, "round_robin")
    victim = two_by_two.member("decode1")
    box: list[Answer] = []
    clients = [threading.Thread(target=lambda i=i: box.append(ask(router, prompt(500 + i), max_tokens=800)),
                                daemon=True) for i in range(2)]
    for client in clients:
        client.start()
    wait_until(lambda: two_by_two.state("decode1")["in_flight"] >= 1, 60, "a request decoding on decode1")
    two_by_two.signal("decode1", signal.SIGKILL)
    for client in clients:
        client.join(90)
    assert len(box) == 2, "a client is still waiting"
    failed = [a for a in box if a.status != 200]
    assert failed, f"the request on the killed D succeeded: {box}"
    for answer in failed:
        assert answer.status == 500 and victim.url in answer.body, answer
    wait_until(lambda: not health(router)[victim.url], 30, "vllm-router taking the killed D out")
    before = requests_served(two_by_two, "decode")
    for i in range(600, 604):
        assert text_of(ask(router, prompt(i))) == expected[prompt(i)]
    assert requests_served(two_by_two, "decode") - before == 4
    wait_clean([m.url for m in two_by_two.members if m.name != "decode1"], NUM_BLOCKS, 45)  # a P whose D died may free only at its lease or peer-loss deadline; 15 s was missed once under load
    two_by_two.restart("decode1")
    wait_until(lambda: all(health(router).values()), 30, "every instance back in rotation")
    assert_clean(two_by_two)
