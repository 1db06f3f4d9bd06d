"""A Gated DeltaNet hybrid at TP 2 inside vLLM: the GDN conv state (Q | K | V), the recurrent
state and the attention heads split over two ranks.

The model is the tiny Qwen3-Next-like GDN hybrid of `test_pd_gdn.py` with 2 GDN key heads, 4
value heads and 2 attention KV heads (`kvlink vllm-models --model tiny-qwen3-next-gdn-tp`),
so that TP 2 gives each rank one key head, two value heads and one KV head. As there, every
server prefills in chunks of CHUNK tokens and each prompt is k x CHUNK + 1 token ids long, so
that colocated vLLM computes the last prompt token alone, as D does.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from vllm_client import load_through, metric, wait_metric

from kvlink.connector.secret import new_secret
from kvlink.integrations.vllm.launch import VllmServerSpec, served_model
from kvlink.integrations.vllm.models import tiny_qwen3_next_tp_dir
from kvlink.procs.launcher import Service

if TYPE_CHECKING:
    from tests.vllm.conftest import VllmServers

pytestmark = pytest.mark.slow

CHUNK = 64
GDN_ARGS = ["--no-enable-prefix-caching", "--max-num-batched-tokens", str(CHUNK)]
PROMPTS = [[(7919 * i + 31 * k) % 40000 + 100 for i in range(k * CHUNK + 1)] for k in (1, 3, 6)]
VERIFIED = "vllm:kvlink_kv_verified_units_total"
MISMATCH = "vllm:kvlink_kv_checksum_mismatch_total"


@pytest.fixture(scope="module")
def gdn_dir() -> Path:
    return tiny_qwen3_next_tp_dir()


def _colocated(vllm_servers: VllmServers, gdn_dir: Path, tp: int) -> VllmServerSpec:
    return VllmServerSpec(model=gdn_dir, port=vllm_servers.http_port(), cores="0|1" if tp == 2 else "0",
                          enforce_eager=True, dtype="bfloat16", args=GDN_ARGS, name=f"gdn-tp{tp}-colocated",
                          tensor_parallel_size=tp)


@pytest.fixture(scope="module")
def references(vllm_servers: VllmServers, gdn_dir: Path) -> dict[int, list[list[int]]]:
    """Colocated vLLM's answers at TP 1 and at TP 2 (same flags, no connector; both servers
    started at once)."""
    tp1, tp2 = (_colocated(vllm_servers, gdn_dir, tp) for tp in (1, 2))
    return {1: vllm_servers.colocated_answers(tp1, PROMPTS, alongside=[tp2]),
            2: vllm_servers.colocated_answers(tp2, PROMPTS)}


SECRET = new_secret()


@pytest.fixture(scope="module")
def servers(vllm_servers: VllmServers, gdn_dir: Path, references: dict[int, list[list[int]]]) -> Iterator[dict[str, Service]]:
    """P and D at TP 2 (one core per rank), and a TP 1 server; D checks every unit (verify_kv full)."""
    specs = []
    for name, tp, cores in (("p2", 2, "0|1"), ("d2", 2, "0|1"), ("one", 1, "1")):
        specs.append(vllm_servers.kvlink_spec(gdn_dir, f"gdn-{name}", cores, SECRET, dtype="bfloat16", args=GDN_ARGS,
                                              extra={"verify_kv": "full"}, tensor_parallel_size=tp))
        if tp == 2:
            vllm_servers.side_channel_port()  # rank 1 listens on the next port
    for started in vllm_servers.serve(*specs):
        yield dict(zip(("p2", "d2", "one"), started, strict=True))


def test_the_reference_text_depends_on_the_prompt(references: dict[int, list[list[int]]]) -> None:
    for answers in references.values():
        assert len({tuple(ids[:4]) for ids in answers}) == len(PROMPTS)


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_tp2_to_tp2_equals_colocated(servers: dict[str, Service], references: dict[int, list[list[int]]],
                                     mode: str, index: int) -> None:
    """Each D rank reads its own P rank's half: the answer is colocated TP 2 vLLM's."""
    p, d = servers["p2"], servers["d2"]
    prompt: Any = PROMPTS[index]
    assert load_through(p, d, served_model(p.url), prompt, mode, groups=4, d_ranks=2) == references[2][index]


@pytest.mark.parametrize("direction", ["2->1", "1->2"])
@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_between_tp_sizes_moves_every_byte(servers: dict[str, Service], references: dict[int, list[list[int]]],
                                           direction: str, index: int) -> None:
    """TP 2 -> 1: the TP 1 rank reads each P rank's heads (GDN key and value heads, the conv
    state's Q | K | V channels of those heads, the attention KV head); TP 1 -> 2: each D rank
    reads its half of the one P rank's pages. D checks every unit against P's digests
    (verify_kv full). The answers are not compared token for token: in bf16 a state computed
    at TP 2 rounds differently from one computed at TP 1, so colocated vLLM at D's TP is no
    exact reference (the runs here agreed on the first 2 to 16 of 16 tokens)."""
    p, d = (servers["p2"], servers["one"]) if direction == "2->1" else (servers["one"], servers["d2"])
    prompt: Any = PROMPTS[index]
    checked, bad = metric(d.url, VERIFIED), metric(d.url, MISMATCH)
    got = load_through(p, d, served_model(p.url), prompt, "pull", groups=4, d_ranks=1 if direction == "2->1" else 2)
    assert wait_metric(d.url, VERIFIED, checked) > checked and metric(d.url, MISMATCH) == bad
    assert len(got) == len(references[1][index]) and len(set(got)) > 1
