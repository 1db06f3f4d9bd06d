"""A Gated DeltaNet hybrid (Qwen3-Next-like) inside vLLM: P → D equals colocated, token for token.

The model is a seeded-random Qwen3NextForCausalLM in bf16 (vLLM's CPU GDN kernel takes bf16
only): 3 GDN layers (1 key head, 2 value heads, head dims 128) and 1 full-attention layer.
vLLM's defaults otherwise: its GDN page holds the conv state in bf16 and the recurrent state
in fp32, row-first (SD) conv layout; vLLM sizes the attention block itself for this model
(640 tokens here), so the long prompt spans two blocks. Without prefix caching, as the Mamba2
hybrid runs (docs/vllm.md).

Same computation on both sides: P computes N-1 prompt tokens and D the last one, where a
colocated vLLM computes the prompt in one prefill; in bf16 the chunked GDN kernel and a
one-token step round differently, and a first try with ~170-token text prompts diverged
from the 5th generated token on. So every server prefills in chunks of CHUNK tokens and each
prompt is k x CHUNK + 1 token ids long: colocated vLLM then also computes the last prompt
token alone, after the same chunks P computes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from layerwise_client import layerwise_answers
from vllm_client import STAGED, load_through, metric, wait_metric

from kvlink.connector.secret import new_secret
from kvlink.integrations.vllm.launch import VllmServerSpec, served_model
from kvlink.integrations.vllm.models import tiny_qwen3_next_dir
from kvlink.procs.launcher import Service

if TYPE_CHECKING:
    from tests.vllm.conftest import VllmServers

pytestmark = pytest.mark.slow

CHUNK = 64
GDN_ARGS = ["--no-enable-prefix-caching", "--max-num-batched-tokens", str(CHUNK)]
# 65, 193 and 705 token ids: one chunk, three, and eleven (past the 640-token block).
PROMPTS = [[(7919 * i + 31 * k) % 40000 + 100 for i in range(k * CHUNK + 1)] for k in (1, 3, 11)]


@pytest.fixture(scope="module")
def gdn_dir() -> Path:
    return tiny_qwen3_next_dir()


GDN_SECRET = new_secret()  # the module's servers sign alike


@pytest.fixture(scope="module")
def pair_specs(vllm_servers: VllmServers, gdn_dir: Path) -> list[VllmServerSpec]:
    return [vllm_servers.kvlink_spec(gdn_dir, f"gdn-{name}", cores, GDN_SECRET, dtype="bfloat16", args=GDN_ARGS)
            for name, cores in (("p", "0"), ("d", "1"))]


@pytest.fixture(scope="module")
def references(vllm_servers: VllmServers, gdn_dir: Path, pair_specs: list[VllmServerSpec],
               ds_spec: VllmServerSpec) -> list[list[int]]:
    spec = VllmServerSpec(model=gdn_dir, port=vllm_servers.http_port(), cores="0", enforce_eager=True,
                          dtype="bfloat16", args=GDN_ARGS, name="gdn-colocated")
    return vllm_servers.colocated_answers(spec, PROMPTS, alongside=[*pair_specs, ds_spec])


@pytest.fixture(scope="module")
def ds_spec(vllm_servers: VllmServers, gdn_dir: Path) -> VllmServerSpec:
    """A server keeping the GDN conv state channel-first (DS), in the pair's secret."""
    return vllm_servers.kvlink_spec(gdn_dir, "gdn-ds", "0", GDN_SECRET, dtype="bfloat16", args=GDN_ARGS,
                                    env={"VLLM_SSM_CONV_STATE_LAYOUT": "DS"})


@pytest.fixture(scope="module")
def wide_spec(vllm_servers: VllmServers, gdn_dir: Path) -> VllmServerSpec:
    """A server of 1280-token blocks (the pair's are vLLM's 640), in the pair's secret."""
    return vllm_servers.kvlink_spec(gdn_dir, "gdn-wide", "0", GDN_SECRET, dtype="bfloat16", args=GDN_ARGS,
                                    block_size=WIDE_BLOCK)


@pytest.fixture(scope="module")
def gdn_pair(vllm_servers: VllmServers, pair_specs: list[VllmServerSpec],
             references: list[list[int]]) -> Iterator[list[Service]]:
    yield from vllm_servers.serve(*pair_specs)


def test_the_reference_text_depends_on_the_prompt(references: list[list[int]]) -> None:
    assert len({tuple(ids[:4]) for ids in references}) == len(PROMPTS)


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_gdn_pd_equals_colocated(gdn_pair: list[Service], references: list[list[int]],
                                 mode: str, index: int) -> None:
    p, d = gdn_pair
    model = served_model(p.url)
    prompt: Any = PROMPTS[index]  # token ids (no prefix caching: pull and push may share them)
    assert load_through(p, d, model, prompt, mode, groups=4) == references[index]  # 3 GDN groups, 1 attention
    for side in (p, d):
        assert "GDN layers keep their conv state SD" in side.log_path.read_text(errors="replace")


@pytest.fixture(scope="module")
def gdn_ds(vllm_servers: VllmServers, ds_spec: VllmServerSpec, gdn_pair: list[Service]) -> Iterator[Service]:
    for (server,) in vllm_servers.serve(ds_spec):
        yield server


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("direction", ["DS->SD", "SD->DS"])
@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_gdn_between_conv_layouts_equals_colocated(gdn_pair: list[Service], gdn_ds: Service,
                                                   references: list[list[int]], direction: str, mode: str,
                                                   index: int) -> None:
    """One side keeps the conv state DS, the other SD: D re-lays the Q | K | V conv state out."""
    p, d = (gdn_ds, gdn_pair[1]) if direction == "DS->SD" else (gdn_pair[0], gdn_ds)
    assert "GDN layers keep their conv state DS" in gdn_ds.log_path.read_text(errors="replace")
    relaid = metric(d.url, "vllm:kvlink_conv_relayout_bytes_total")
    prompt: Any = PROMPTS[index]
    assert load_through(p, d, served_model(p.url), prompt, mode, groups=4) == references[index]
    assert wait_metric(d.url, "vllm:kvlink_conv_relayout_bytes_total", relaid) > relaid


def test_gdn_layerwise_over_a_chunked_prefill_equals_colocated(gdn_pair: list[Service], references: list[list[int]],
                                                               tmp_path: Path) -> None:
    """`kvlink proxy --mode layerwise` in front of the GDN P and D: P prefills in chunks of
    CHUNK tokens and WRITEs each layer's finished blocks after each forward, the GDN state
    once the prompt is through; D reads nothing and answers what colocated vLLM answers. The
    first request goes the classic way (the proxy learns P's side channel from it)."""
    p, d = gdn_pair
    got = layerwise_answers(p, d, served_model(p.url), list(PROMPTS), tmp_path, held={len(PROMPTS) - 1})
    assert [ids for ids, _ in got] == references
    writes = [w for _, w in got]
    # 705 tokens take 11 forwards: the blocks they complete go out as they do, before `pushed`
    # (the prompt went with P held until D had asked, so however late D asks under load)
    assert writes[-1] > 1, f"P wrote the longest prompt in {writes[-1]} WRITEs: not streamed"


WIDE_BLOCK = 1280  # vLLM keeps a --block-size above the one it sizes for the GDN page (640 here)


# Started for its class, not while the tests before it run: a server starting beside P takes
# its core, and the layerwise test counts P's WRITEs during the forward.
@pytest.fixture(scope="class")
def gdn_wide(vllm_servers: VllmServers, wide_spec: VllmServerSpec, gdn_pair: list[Service]) -> Iterator[Service]:
    for (server,) in vllm_servers.serve(wide_spec):
        yield server


class TestBetweenBlockSizes:
    """P and D of different block sizes: D reads whole P pages of the attention layer into its
    staging pages and each GDN layer's state page (conv and recurrent state, padded to the
    attention page) whole, then copies the tokens into its blocks and the state into its own
    state block, whose padding differs."""

    # every prompt pulled; the longest (two P blocks of 640) also pushed, which D runs as a staged pull
    @pytest.mark.parametrize("index,mode", [(0, "pull"), (1, "pull"), (2, "pull"), (2, "push")])
    @pytest.mark.parametrize("direction", ["640->1280", "1280->640"])
    def test_pd_equals_colocated(self, gdn_pair: list[Service], gdn_wide: Service, references: list[list[int]],
                                 mode: str, direction: str, index: int) -> None:
        p, d = (gdn_pair[0], gdn_wide) if direction == "640->1280" else (gdn_wide, gdn_pair[1])
        assert f"blocks of {WIDE_BLOCK} tokens" in gdn_wide.log_path.read_text(errors="replace")  # vLLM kept it
        staged = metric(d.url, STAGED)
        prompt: Any = PROMPTS[index]
        assert load_through(p, d, served_model(p.url), prompt, mode, groups=4) == references[index]
        assert wait_metric(d.url, STAGED, staged) > staged  # through D's staging pages (a push as a staged pull)
