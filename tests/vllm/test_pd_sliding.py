"""Sliding-window models inside vLLM: P → D equals colocated, token for token.

The model is a seeded-random Gemma-3-like text model (`kvlink vllm-models`: 3 layers with a
window of 64 tokens, then 1 global layer; 1 KV head of 64, fp32, blocks of 32 tokens). With
vLLM's hybrid KV-cache allocator on (its default with kvlink, which supports it) the layers
form separate groups, a `SlidingWindowSpec` group per local layer and a `FullAttentionSpec`
group, aliasing one allocation; vLLM's P frees the blocks behind the window to its null
block 0 and D gives them no memory. kvlink ships the sliding groups' blocks inside the window
only, and the full group's blocks whole: the test counts the bytes D's connector loaded.

Prompts run from shorter than the window to many windows long; D's answer must equal a
colocated vLLM's (same flags, no connector), and the colocated answers must differ from
prompt to prompt (a seeded-random model whose text ignores the prompt would prove nothing).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from layerwise_client import layerwise_answers, writes_during_prefill
from vllm_client import STAGED, PdPair, complete, metric, token_ids, wait_metric

from kvlink.connector.secret import new_secret
from kvlink.integrations.vllm.launch import VllmServerSpec, served_model
from kvlink.integrations.vllm.models import TINY_SLIDING_WINDOW, tiny_gemma3_dir
from kvlink.procs.launcher import Service

if TYPE_CHECKING:
    from tests.vllm.conftest import VllmServers

pytestmark = pytest.mark.slow

BLOCK = 32
WINDOW = TINY_SLIDING_WINDOW
LOCAL_LAYERS, GLOBAL_LAYERS = 3, 1
PAGE_BYTES = BLOCK * 1 * 2 * 64 * 4  # one layer's block: 32 tokens, 1 KV head, K and V of 64, fp32
VERIFIED = "vllm:kvlink_kv_verified_units_total"
PROMPTS = ["The last keeper of the lighthouse was",
           " ".join(f"Line {i}: the tide came in over the rocks." for i in range(14)),
           " ".join(f"Entry {i} of the keeper's log mentions a storm." for i in range(30))]
# Prefill in chunks of 128 tokens (every server: the same flags): between chunks vLLM frees the
# blocks behind the window, so P's long prompts hand over lists that start with null blocks.
ARGS = ["--max-num-batched-tokens", "128"]
CHUNK = 128
HITS = "vllm:prefix_cache_hits_total"
OFF_ARGS = [*ARGS, "--disable-hybrid-kv-cache-manager", "--no-enable-prefix-caching"]
PREFIX = " ".join(f"Note {i}: the lamp was trimmed at dusk." for i in range(20))
EXTENDED = PREFIX + " Then the fog came and the bell rang all night."


def tagged() -> list[str]:
    return ([f"({mode}) {p}" for mode in ("pull", "push", "layerwise") for p in PROMPTS] + [PREFIX, EXTENDED]
            + [between(direction, mode, i) for direction in DIRECTIONS for mode in ("pull", "push", "layerwise")
               for i in (1, 2)])


DIRECTIONS = ("64->32", "32->64")


def between(direction: str, mode: str, index: int = 2) -> str:
    return f"({mode} {direction}) {PROMPTS[index]}"


def expected_bytes(num_tokens: int, computed: int = 0) -> int:
    """KV bytes D loads for a prompt of `num_tokens` (D recomputes the last) over a prefix hit
    of `computed` tokens: the global layer's blocks from the hit on, each local layer's from
    the block holding the first token the recomputed one attends to (vLLM's window ends at
    the attending position), and never a block D already holds."""
    shipped = num_tokens - 1
    last_block = -(-shipped // BLOCK)
    window_block = max(0, num_tokens - WINDOW) // BLOCK
    hit_block = computed // BLOCK
    full = max(0, last_block - hit_block)
    local = max(0, last_block - max(hit_block, window_block))
    return (GLOBAL_LAYERS * full + LOCAL_LAYERS * local) * PAGE_BYTES


def staged_bytes(num_tokens: int, p_block: int) -> int:
    """KV bytes D reads between block sizes: whole P pages into its staging pages, the global
    layer's every page, each local layer's from the page holding the first token the
    recomputed one attends to."""
    pages = -(-(num_tokens - 1) // p_block)
    window_page = max(0, num_tokens - WINDOW) // p_block
    return (GLOBAL_LAYERS * pages + LOCAL_LAYERS * (pages - window_page)) * p_block * PAGE_BYTES // BLOCK


@pytest.fixture(scope="module")
def gemma_dir() -> Path:
    return tiny_gemma3_dir()


@pytest.fixture(scope="module")
def secret() -> str:
    return new_secret()


@pytest.fixture(scope="module")
def pair_specs(vllm_servers: VllmServers, gemma_dir: Path, secret: str) -> list[VllmServerSpec]:
    return [vllm_servers.kvlink_spec(gemma_dir, f"swa-{name}", cores, secret, block_size=BLOCK, args=ARGS)
            for name, cores in (("p", "0"), ("d", "1"))]


@pytest.fixture(scope="module")
def spec_64(vllm_servers: VllmServers, gemma_dir: Path, secret: str) -> VllmServerSpec:
    """A server of 64-token blocks (allocator on)."""
    return vllm_servers.kvlink_spec(gemma_dir, "swa-64", "1", secret, block_size=2 * BLOCK, args=ARGS)


@pytest.fixture(scope="module")
def off_specs(vllm_servers: VllmServers, gemma_dir: Path) -> list[VllmServerSpec]:
    """Two servers with the hybrid allocator off, of 32- and 64-token blocks, in a secret of their own."""
    secret = new_secret()
    return [vllm_servers.kvlink_spec(gemma_dir, f"swa-off-{block}", cores, secret, block_size=block, args=OFF_ARGS)
            for block, cores in ((BLOCK, "0"), (2 * BLOCK, "1"))]


@pytest.fixture(scope="module")
def references(vllm_servers: VllmServers, gemma_dir: Path, pair_specs: list[VllmServerSpec],
               spec_64: VllmServerSpec) -> dict[str, list[int]]:
    spec = VllmServerSpec(model=gemma_dir, port=vllm_servers.http_port(), block_size=BLOCK, cores="0",
                          enforce_eager=True, args=ARGS, name="swa-colocated")
    return vllm_servers.colocated_token_ids(spec, tagged(), alongside=[*pair_specs, spec_64])


@pytest.fixture(scope="module")
def pair(vllm_servers: VllmServers, pair_specs: list[VllmServerSpec],
         references: dict[str, list[int]]) -> Iterator[PdPair]:
    for services in vllm_servers.serve(*pair_specs):
        p, d = services
        yield PdPair(p, d, served_model(p.url))


def test_greedy_text_follows_the_prompt(references: dict[str, list[int]]) -> None:
    answers = [tuple(references[f"(pull) {p}"]) for p in PROMPTS] + [tuple(references[PREFIX])]
    assert len(set(answers)) == len(answers)
    assert len({a[0] for a in answers}) > 1
    assert all(len(set(a)) > 1 for a in answers)  # not one token over and over


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_sliding_pd_equals_colocated(pair: PdPair, references: dict[str, list[int]], mode: str, index: int) -> None:
    prompt = f"({mode}) {PROMPTS[index]}"
    checked = metric(pair.d.url, VERIFIED)
    ids, params, nbytes = pair.run(prompt, mode)
    n = pair.tokens(prompt)
    assert len(params["remote_block_ids"]) == LOCAL_LAYERS + GLOBAL_LAYERS  # one list per KV-cache group
    if n > 2 * CHUNK:  # P freed what lay behind the window: its sliding lists start with null blocks
        assert sum(ids_[0] == 0 for ids_ in params["remote_block_ids"]) == LOCAL_LAYERS
    assert ids == references[prompt]
    if mode == "pull":
        assert nbytes == expected_bytes(n)
    assert wait_metric(pair.d.url, VERIFIED, checked) > checked  # D checked P's digests


def test_layerwise_through_kvlink_proxy_equals_colocated(pair: PdPair, references: dict[str, list[int]],
                                                         tmp_path: Path) -> None:
    """`kvlink proxy --mode layerwise` in front of the pair: P prefills in chunks of CHUNK
    tokens and WRITEs each layer's finished blocks after each forward, the sliding layers'
    inside the final window only (P frees the blocks behind the window between chunks: those
    were never to be written); D reads nothing and answers what colocated vLLM answers. The
    first request goes the classic way (the proxy learns P's side channel from it)."""
    prompts = [f"(layerwise) {prompt}" for prompt in PROMPTS]
    logged = len(writes_during_prefill(pair.p))
    got = layerwise_answers(pair.p, pair.d, pair.model, prompts, tmp_path, held={len(prompts) - 1})
    assert [ids for ids, _ in got] == [references[prompt] for prompt in prompts]
    pushes = writes_during_prefill(pair.p)[logged:]
    assert len(pushes) == len(PROMPTS), pushes
    # P writes during the prefill once D asked before its forwards ended; under load D may ask
    # later (the WRITEs then come after the prefill, still exact, as above). The longest prompt
    # went with P held until D had asked: its prefill streamed over several chunks.
    assert pushes[-1] > LOCAL_LAYERS + GLOBAL_LAYERS, f"P never wrote over several chunks: {pushes}"


def test_d_prefix_hit_moves_only_the_missing_part(pair: PdPair, references: dict[str, list[int]]) -> None:
    ids, _, first_bytes = pair.run(PREFIX, "pull")
    assert ids == references[PREFIX]
    assert first_bytes == expected_bytes(pair.tokens(PREFIX))
    hits = metric(pair.d.url, HITS)
    ids, _, nbytes = pair.run(EXTENDED, "pull")
    assert ids == references[EXTENDED]
    hit = int(metric(pair.d.url, HITS) - hits)  # tokens of D's own prefix cache, as vLLM counted them
    assert hit > 0 and hit % BLOCK == 0
    assert nbytes == expected_bytes(pair.tokens(EXTENDED), hit)
    assert 0 < nbytes < expected_bytes(pair.tokens(EXTENDED))


@pytest.fixture(scope="class")
def big(vllm_servers: VllmServers, spec_64: VllmServerSpec, off_specs: list[VllmServerSpec],
        pair: PdPair) -> Iterator[Service]:
    """The 64-token server, for the class below only. The first allocator-off server starts
    meanwhile: after the layerwise test, which counts P's WRITEs during the forward (a server
    starting beside P takes its core)."""
    for (server,) in vllm_servers.serve(spec_64, alongside=off_specs[:1]):
        yield server


class TestBetweenBlockSizes:
    """The hybrid allocator on (groups aliasing one allocation, P's sliding lists starting with
    null blocks) and P and D of different block sizes: D reads whole P pages of every layer
    into its staging pages (the sliding layers' from the window on) and copies each group's
    tokens into that group's own blocks. A third server, of 64-token blocks, lives for this
    class only (the module's other servers are two; the allocator-off pair comes after)."""

    @staticmethod
    def ends(pair: PdPair, big: Service, direction: str) -> tuple[Any, Any, int]:
        return (big, pair.d, 2 * BLOCK) if direction == "64->32" else (pair.p, big, BLOCK)

    @pytest.mark.parametrize("direction", DIRECTIONS)
    @pytest.mark.parametrize("mode", ["pull", "push"])
    @pytest.mark.parametrize("index", [1, 2])
    def test_pd_equals_colocated(self, pair: PdPair, big: Service, references: dict[str, list[int]],
                                 direction: str, mode: str, index: int) -> None:
        p, d, p_block = self.ends(pair, big, direction)
        prompt = between(direction, mode, index)
        checked, staged = metric(d.url, VERIFIED), metric(d.url, STAGED)
        ids, params, nbytes = pair.run(prompt, mode, p, d)
        n = pair.tokens(prompt)
        assert len(params["remote_block_ids"]) == LOCAL_LAYERS + GLOBAL_LAYERS
        if n > 2 * CHUNK:  # P freed what lay behind the window
            assert sum(ids_[0] == 0 for ids_ in params["remote_block_ids"]) == LOCAL_LAYERS
        assert ids == references[prompt]
        if mode == "pull":  # whole P pages, the sliding layers' from the window on
            assert nbytes == staged_bytes(n, p_block)
        assert wait_metric(d.url, STAGED, staged) > staged  # through D's staging pages (a push as a staged pull)
        assert wait_metric(d.url, VERIFIED, checked) > checked  # D checked P's digests on the staged pages

    @pytest.mark.parametrize("direction", DIRECTIONS)
    def test_layerwise_equals_colocated(self, pair: PdPair, big: Service, references: dict[str, list[int]],
                                        direction: str, tmp_path: Path) -> None:
        """`kvlink proxy --mode layerwise`: P WRITEs each layer's whole pages into D's staging
        pages as its chunks finish (the sliding layers' inside the final window), D re-lays them
        out into each group's blocks and reads nothing."""
        p, d, _ = self.ends(pair, big, direction)
        prompts = [between(direction, "layerwise", i) for i in (1, 2)]
        staged = metric(d.url, STAGED)
        got = layerwise_answers(p, d, pair.model, prompts, tmp_path, name=f"router-layerwise-{direction[:2]}")
        assert [ids for ids, _ in got] == [references[prompt] for prompt in prompts]
        assert metric(d.url, STAGED) >= staged + len(prompts)

# The hybrid allocator off: one FullAttentionSpec group (with a sliding window) of all four
# layers, every block kept, so the KV moves whole. Its servers, of 32- and 64-token blocks and
# without prefix caching, answer a prompt themselves before they load that prompt's KV; between
# block sizes D reads whole P blocks into staging pages and re-lays them out.
@pytest.fixture(scope="module")
def allocator_off(vllm_servers: VllmServers, off_specs: list[VllmServerSpec],
                  pair: PdPair) -> Iterator[dict[int, Service]]:
    for services in vllm_servers.serve(*off_specs):
        yield {BLOCK: services[0], 2 * BLOCK: services[1]}


def test_allocator_off_answers_as_on(allocator_off: dict[int, Service], pair: PdPair,
                                     references: dict[str, list[int]]) -> None:
    for server in allocator_off.values():
        assert token_ids(complete(server.url, pair.model, PREFIX)) == references[PREFIX]


@pytest.mark.parametrize("direction", [(BLOCK, 2 * BLOCK), (2 * BLOCK, BLOCK)], ids=["32->64", "64->32"])
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_allocator_off_pd_equals_colocated(allocator_off: dict[int, Service], pair: PdPair,
                                           direction: tuple[int, int], mode: str) -> None:
    p_block, d_block = direction
    p, d = allocator_off[p_block], allocator_off[d_block]
    prompt = f"({mode} {p_block}->{d_block}) {PROMPTS[2]}"
    expected = token_ids(complete(d.url, pair.model, prompt))  # D's own answer (no prefix caching)
    checked = metric(d.url, VERIFIED)
    ids, params, nbytes = pair.run(prompt, mode, p, d)
    assert len(params["remote_block_ids"]) == 1 and 0 not in params["remote_block_ids"][0]
    assert ids == expected
    n = pair.tokens(prompt)
    if mode == "pull":  # every layer's blocks, whole P blocks between block sizes
        assert nbytes == -(-(n - 1) // p_block) * p_block * (LOCAL_LAYERS + GLOBAL_LAYERS) * PAGE_BYTES // BLOCK
    assert wait_metric(d.url, VERIFIED, checked) > checked
