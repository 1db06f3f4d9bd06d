"""The MLA model inside vLLM on `AMX_MLA`, vLLM's CPU default for MLA where the CPU has AMX
tiles: the latents D decodes from are P's, byte for byte (`verify_kv` full), P block 32 → D
block 128 and back answer what P block 32 → D block 32 answers, pull and push, and a D prefix
hit moves only the rest.

`AMX_MLA` takes block sizes that are multiples of 32 and keeps prefix caching (`CPU_MLA`, run in
`test_pd_mla.py`, takes block 16 only and turns it off). It needs AMX tiles
(`torch.cpu._is_amx_tile_supported()`), so this module runs only on such a machine.

Why the answers are compared between P/D pairs and not with colocated vLLM: on AMX_MLA vLLM's
own answers depend on the path a prompt takes. One colocated server with prefix caching on
answered 3 of 6 prompts differently the second time (a prefix hit runs the extend kernel over
cached latents), and P/D with a fresh P and D differed from colocated on some prompts at the
same block size, with D's bytes equal to P's (docs/vllm.md, MLA models). So the answer servers
run without prefix caching, every request takes the same path (P's fresh prefill of the whole
prompt, D's decode of the last prompt token over the loaded latents), and a pair between block
sizes must answer exactly what the pair of equal block sizes answers. A fourth server, with
prefix caching, takes the D prefix hit (bytes asserted).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from layerwise_client import layerwise_answers, writes_during_prefill
from test_pd_mla import (
    BYTES_PER_TOKEN,
    MAX_TOKENS,
    MODEL_DTYPE,
    PROMPTS,
    block_of,
)
from vllm_client import PdPair, metric

from kvlink.connector.secret import new_secret
from kvlink.integrations.vllm.launch import served_model
from kvlink.integrations.vllm.models import tiny_deepseek_mla_dir
from kvlink.procs.launcher import Service

if TYPE_CHECKING:
    from tests.vllm.conftest import VllmServers

torch = pytest.importorskip("torch")
AMX = bool(torch.cpu._is_amx_tile_supported())
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not AMX, reason="AMX_MLA runs only on a CPU with AMX tiles; "
                                 "this machine has none (CPU_MLA is run in test_pd_mla.py)")]

BACKEND = "AMX_MLA"
VERIFIED = "vllm:kvlink_kv_verified_units_total"
# name -> (block size, core, prefix caching)
SERVERS = {"a32": (32, "0", False), "b32": (32, "1", False), "c128": (128, "1", False), "h32": (32, "0", True)}
# (P, D) per case; "same" answers are the reference for the others
CASES = {"same": ("a32", "b32"), "up": ("a32", "c128"), "down": ("c128", "b32")}


@pytest.fixture(scope="module")
def servers(vllm_servers: VllmServers) -> Iterator[dict[str, Service]]:
    model, secret = tiny_deepseek_mla_dir(), new_secret()
    specs = []
    for name, (block, core, caching) in SERVERS.items():
        args = ["--attention-backend", BACKEND, *(() if caching else ("--no-enable-prefix-caching",))]
        specs.append(vllm_servers.kvlink_spec(model, f"mla-amx-{name}-block{block}", core, secret, block_size=block,
                                              dtype=MODEL_DTYPE, args=args, extra={"verify_kv": "full"}))
    for started in vllm_servers.serve(*specs):
        yield dict(zip(SERVERS, started, strict=True))


def expected_bytes(tokens: int, p_block: int, d_block: int) -> int:
    """The N-1 tokens P computed (D recomputes the last prompt token): MLA pages keep a token's
    latent in one run, so D reads whole blocks of the smaller size, whatever the pair."""
    unit = min(p_block, d_block)
    return -(-(tokens - 1) // unit) * unit * BYTES_PER_TOKEN


@pytest.fixture(scope="module")
def answers(servers: dict[str, Service]) -> dict[tuple[str, str, int], tuple[list[int], int, float, float]]:
    """(mode, case, prompt index) -> (D's answer, prompt tokens, D's bytes, D's verified units)."""
    out = {}
    for mode in ("pull", "push"):
        for case, (p, d) in CASES.items():
            for index, text in enumerate(PROMPTS):
                server = servers[d]
                checked = metric(server.url, VERIFIED)
                pd = PdPair(servers[p], server, served_model(server.url))
                prompt = f"(amx {mode}) {text}"
                got, _, nbytes = pd.run(prompt, mode)  # D's bytes read: a push is P's WRITE
                tokens = pd.tokens(prompt)
                deadline = time.monotonic() + 5
                while metric(server.url, VERIFIED) == checked and time.monotonic() < deadline:
                    time.sleep(0.1)
                out[(mode, case, index)] = (got, tokens, nbytes, metric(server.url, VERIFIED) - checked)
    return out


def test_servers_run_amx_mla(servers: dict[str, Service]) -> None:
    for server in servers.values():
        found = re.findall(r"kvlink: vLLM's MLA layers run (\w+) \(latent (\d+) of (\w+), block (\d+)\): "
                           r"page order (\w+)", server.log_path.read_text(errors="replace"))
        assert found and found[-1] == (BACKEND, "576", MODEL_DTYPE, str(block_of(server)), "token_major"), found


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_the_answers_follow_the_prompt(answers: dict, mode: str) -> None:
    got = {tuple(answers[(mode, "same", i)][0]) for i in range(len(PROMPTS))}
    assert len(got) == len(PROMPTS), "greedy text must follow the prompt (a wrong KV must show)"


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("case", ["up", "down"])
@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_between_block_sizes_equals_equal_block_sizes(servers: dict[str, Service], answers: dict, mode: str,
                                                      case: str, index: int) -> None:
    got, tokens, nbytes, checked = answers[(mode, case, index)]
    assert got == answers[(mode, "same", index)][0]
    p, d = (servers[name] for name in CASES[case])
    if mode == "pull":  # D's bytes counter counts its reads (a push is P's WRITE)
        assert nbytes == expected_bytes(tokens, block_of(p), block_of(d))
    assert checked > 0, "D did not check P's digests"


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_equal_block_sizes_read_whole_blocks_checked(answers: dict, mode: str, index: int) -> None:
    _, tokens, nbytes, checked = answers[(mode, "same", index)]
    assert nbytes == (expected_bytes(tokens, 32, 32) if mode == "pull" else 0)
    assert checked > 0, "D did not check P's digests"


def test_d_prefix_hit_moves_only_the_rest(servers: dict[str, Service]) -> None:
    """AMX_MLA keeps vLLM's prefix cache: the second time D holds every full block of the prompt
    and loads only the last, partial one (the answers are not compared: a prefix hit takes
    vLLM's extend path, which answers differently on its own)."""
    pd = PdPair(servers["a32"], servers["h32"], served_model(servers["a32"].url))
    prompt = f"(amx hit) {PROMPTS[2]}"
    tokens = pd.tokens(prompt)
    _, _, first = pd.run(prompt, "pull")
    whole = expected_bytes(tokens, 32, 32)
    assert first == whole
    second, _, nbytes = pd.run(prompt, "pull")
    assert len(second) == MAX_TOKENS
    want = whole - (tokens - 1) // 32 * 32 * BYTES_PER_TOKEN
    assert 0 < want < whole
    assert nbytes == want


def test_layerwise_equals_the_classic_pull(servers: dict[str, Service], answers: dict, tmp_path: Path) -> None:
    """`kvlink proxy --mode layerwise` in front of a32 and b32: P WRITEs each MLA layer's latents
    from vLLM's `save_kv_layer` during its forward, D reads nothing and answers what the
    classic pull of the same prompt answered (same servers, same path: no prefix caching). The
    first request goes the classic way (the proxy learns P's side channel from it)."""
    p, d = servers["a32"], servers["b32"]
    prompts = [f"(amx pull) {text}" for text in PROMPTS]
    logged = len(writes_during_prefill(p))
    got = layerwise_answers(p, d, served_model(p.url), prompts, tmp_path, held={len(prompts) - 1},
                            max_tokens=MAX_TOKENS)
    assert [ids for ids, _ in got] == [answers[("pull", "same", i)][0] for i in range(len(PROMPTS))]
    pushes = writes_during_prefill(p)[logged:]
    # The last prompt went with P held until D had asked: its forward streamed.
    assert len(pushes) == len(PROMPTS) and pushes[-1] > 1, pushes

