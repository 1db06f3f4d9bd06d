"""A sliding window on every layer (Mistral-like) inside vLLM: P → D equals colocated.

The model is a seeded-random Mistral (`kvlink vllm-models`: 2 layers, window 64, 1 KV head of
64, fp32, blocks of 32 tokens). vLLM gives it one `SlidingWindowSpec` group, whose layers own
their memory (nothing aliased), and frees the blocks behind the window to its null block;
kvlink ships only the blocks inside the window, whatever the prompt's length, also between
P and D of different block sizes (through D's staging pages).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from vllm_client import STAGED, PdPair, metric, wait_metric

from kvlink.connector.secret import new_secret
from kvlink.integrations.vllm.launch import VllmServerSpec, served_model
from kvlink.integrations.vllm.models import TINY_SLIDING_WINDOW, tiny_mistral_dir

if TYPE_CHECKING:
    from tests.vllm.conftest import VllmServers

pytestmark = pytest.mark.slow

BLOCK, LAYERS = 32, 2
PAGE_BYTES = BLOCK * 1 * 2 * 64 * 4  # one layer's block: 32 tokens, 1 KV head, K and V of 64, fp32
ARGS = ["--max-num-batched-tokens", "128"]  # prefill in chunks: P frees blocks behind the window
VERIFIED = "vllm:kvlink_kv_verified_units_total"
PROMPTS = ["A recipe for bread:",
           " ".join(f"Line {i}: the tide came in over the rocks." for i in range(14)),
           " ".join(f"Entry {i} of the keeper's log mentions a storm." for i in range(30))]


DIRECTIONS = ("32->64", "64->32")


def tagged() -> list[str]:
    return ([f"({mode}) {p}" for mode in ("pull", "push") for p in PROMPTS]
            + [between(direction, mode, i) for direction in DIRECTIONS for mode in ("pull", "push") for i in (1, 2)])


def between(direction: str, mode: str, index: int) -> str:
    return f"({mode} {direction}) {PROMPTS[index]}"


@pytest.fixture(scope="module")
def mistral_dir() -> Path:
    return tiny_mistral_dir()


@pytest.fixture(scope="module")
def pair_specs(vllm_servers: VllmServers, mistral_dir: Path) -> list[VllmServerSpec]:
    """P and D of 32-token blocks, and a third server of 64-token blocks for the pairs between
    block sizes."""
    secret = new_secret()
    return [vllm_servers.kvlink_spec(mistral_dir, f"uniform-{name}", cores, secret, block_size=block, args=ARGS)
            for name, cores, block in (("p", "0", BLOCK), ("d", "1", BLOCK), ("64", "1", 2 * BLOCK))]


@pytest.fixture(scope="module")
def references(vllm_servers: VllmServers, mistral_dir: Path,
               pair_specs: list[VllmServerSpec]) -> dict[str, list[int]]:
    spec = VllmServerSpec(model=mistral_dir, port=vllm_servers.http_port(), block_size=BLOCK, cores="0",
                          enforce_eager=True, args=ARGS, name="uniform-colocated")
    return vllm_servers.colocated_token_ids(spec, tagged(), alongside=pair_specs)


@pytest.fixture(scope="module")
def pair(vllm_servers: VllmServers, pair_specs: list[VllmServerSpec],
         references: dict[str, list[int]]) -> Iterator[tuple[PdPair, Any]]:
    for services in vllm_servers.serve(*pair_specs):
        p, d, big = services
        yield PdPair(p, d, served_model(p.url)), big


def test_greedy_text_follows_the_prompt(references: dict[str, list[int]]) -> None:
    answers = [tuple(references[f"(pull) {p}"]) for p in PROMPTS]
    assert len(set(answers)) == len(answers) and len({a[0] for a in answers}) > 1
    assert all(len(set(a)) > 1 for a in answers)


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_uniform_window_pd_equals_colocated(pair: tuple[PdPair, Any], references: dict[str, list[int]], mode: str,
                                            index: int) -> None:
    pair_, _ = pair
    prompt = f"({mode}) {PROMPTS[index]}"
    checked = metric(pair_.d.url, VERIFIED)
    ids, params, nbytes = pair_.run(prompt, mode)
    n = pair_.tokens(prompt)
    (listed,) = params["remote_block_ids"]  # one group
    if n > 256:
        assert listed[0] == 0  # freed behind the window on P
    assert ids == references[prompt], ("after the load", n)
    if mode == "pull":  # the blocks from the one holding token N - window on, never more
        in_window = -(-(n - 1) // BLOCK) - max(0, n - TINY_SLIDING_WINDOW) // BLOCK
        assert nbytes == LAYERS * in_window * PAGE_BYTES
    assert wait_metric(pair_.d.url, VERIFIED, checked) > checked


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("index", [1, 2])
def test_uniform_window_between_block_sizes(pair: tuple[PdPair, Any], references: dict[str, list[int]],
                                            direction: str, mode: str, index: int) -> None:
    """P and D of 32- and 64-token blocks: D reads whole P pages from the one holding token
    N - window on into its staging pages and copies the window's tokens into its own blocks (a
    push goes as a staged pull)."""
    pd, big = pair
    p, d, p_block = (pd.p, big, BLOCK) if direction == "32->64" else (big, pd.d, 2 * BLOCK)
    prompt = between(direction, mode, index)
    checked, staged = metric(d.url, VERIFIED), metric(d.url, STAGED)
    ids, params, nbytes = pd.run(prompt, mode, p, d)
    n = pd.tokens(prompt)
    assert len(params["remote_block_ids"]) == 1  # one group
    assert ids == references[prompt], ("after the load", n)
    if mode == "pull":
        in_window = -(-(n - 1) // p_block) - max(0, n - TINY_SLIDING_WINDOW) // p_block
        assert nbytes == LAYERS * in_window * p_block * PAGE_BYTES // BLOCK
    assert wait_metric(d.url, STAGED, staged) > staged
    assert wait_metric(d.url, VERIFIED, checked) > checked
