"""vLLM's CPU attention kernels and fp8 KV caches: page orders checked against vLLM's own
cache-write kernel, the adapter's refusals, and real P → D runs equal to colocated vLLM.

* vLLM picks `vec16` for head sizes that are not multiples of 32 (and would for block sizes
  that are not, but its CPU_ATTN backend refuses those: "No common block size for 16").
  A seeded-random Llama of head size 80 (`kvlink vllm-models --model tiny-llama-head80`)
  runs it: P block 32 → D block 128 and back, staged re-layout in the `vllm_cpu_vec` order.
* `--kv-cache-dtype fp8` (e4m3 bytes, scales 1.0 without a quantized checkpoint): SmolLM2
  fp32 on the `vec` kernel and bf16 on `amx` (with AMX), P block 32 → D block 128 and back,
  against colocated vLLM at fp8.

Each server logs the kernel vLLM resolved for it; the tests read it back from the logs.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np
import pytest
from vllm_client import complete, token_ids

from kvlink.connector.remote import check_payload, encode_geometry
from kvlink.connector.secret import new_secret
from kvlink.integrations.vllm.launch import VllmServerSpec, served_model
from kvlink.integrations.vllm.layout import (
    GroupInfo,
    UnsupportedVllmLayout,
    check_layer_tensors,
    kv_dtype_for,
    page_order_for,
    resolved_isa,
    with_kv_dtype,
)
from kvlink.integrations.vllm.models import tiny_llama_head80_dir
from kvlink.layout.geometry import WorkerGeometry, build_worker_geometry, packed_base_addrs
from kvlink.layout.page_order import element_index
from kvlink.layout.spec import FullAttention, ModelSpec
from kvlink.plan.compat import IncompatibleLayout
from kvlink.procs.launcher import Service
from kvlink.transfer.wire import PROTOCOL_VERSION, HandshakePayload

if TYPE_CHECKING:
    from tests.vllm.conftest import VllmServers

torch = pytest.importorskip("torch")

AMX = bool(torch.cpu._is_amx_tile_supported())
TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# ---- vLLM's cache writes land where the page order says -------------------------------
def _written_order(isa: str, dtype: str, cache_dtype: str, N: int, D: int, heads: int = 2,
                   blocks: int = 2) -> np.ndarray:
    """For every element of the cache, the logical (block, head, part, token, dim) index that
    vLLM's `cpu_attn_reshape_and_cache` wrote there, read back one bit plane at a time (0 and
    1 are exact in every dtype, fp8 included)."""
    import vllm._custom_ops as ops

    tokens = blocks * N
    logical = np.arange(blocks * heads * 2 * N * D).reshape(blocks, heads, 2, N, D)
    # per written token row: [token, head, dim] for K (part 0) and V (part 1)
    k_ids = logical[:, :, 0].transpose(0, 2, 1, 3).reshape(tokens, heads, D)
    v_ids = logical[:, :, 1].transpose(0, 2, 1, 3).reshape(tokens, heads, D)
    storage = TORCH[dtype] if cache_dtype == "auto" else torch.uint8
    decoded = np.zeros(blocks * heads * 2 * N * D, dtype=np.int64)
    for bit in range(int(logical.max()).bit_length()):
        key = torch.from_numpy((k_ids >> bit) & 1).to(TORCH[dtype])
        value = torch.from_numpy((v_ids >> bit) & 1).to(TORCH[dtype])
        cache = torch.zeros(blocks, heads, 2 * N, D, dtype=storage)
        key_cache, value_cache = cache.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, torch.arange(tokens), isa,
                                       kv_cache_dtype=cache_dtype)
        decoded |= (cache.reshape(-1) != 0).numpy().astype(np.int64) << bit
    return decoded


# (model dtype, --kv-cache-dtype, block size, head size): what vLLM's CPU build serves here,
# and the N=16 block vLLM's vec16 kernel would take if CPU_ATTN allowed it.
KERNEL_CASES = [
    ("float32", "auto", 128, 64), ("float32", "auto", 32, 64),
    ("float32", "auto", 32, 80), ("float32", "auto", 128, 112), ("float32", "auto", 16, 64),
    ("bfloat16", "auto", 32, 80), ("bfloat16", "auto", 32, 64), ("bfloat16", "auto", 128, 128),
    ("float32", "fp8", 128, 64), ("float32", "fp8_e5m2", 32, 64),
    ("bfloat16", "fp8", 32, 64), ("bfloat16", "fp8", 128, 128),
]


@pytest.mark.parametrize(("dtype", "cache_dtype", "N", "D"), KERNEL_CASES)
def test_vllm_cache_writes_follow_the_page_order(dtype: str, cache_dtype: str, N: int, D: int) -> None:
    """The page order kvlink picks for vLLM's kernel puts every element where vLLM's own
    cache write puts it: K and V of every token, dim and head, in every kernel named here."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(TORCH[dtype], N, D, cache_dtype)
    if D % 32 or N % 32:
        assert isa == "vec16"
    elif dtype == "bfloat16" and AMX:
        assert isa == "amx"  # with AMX bf16 runs the tiled kernel, fp8 cache or not
    kv_dtype = kv_dtype_for(cache_dtype, dtype)
    order = page_order_for(isa, kv_dtype, N, D)
    heads, blocks = 2, 2
    b, h, p, n, d = np.meshgrid(*(np.arange(x) for x in (blocks, heads, 2, N, D)), indexing="ij")
    unit = 2 * N * D
    where = (b * heads + h) * unit + element_index(order, N, D, p, n, d)
    expected = np.empty(blocks * heads * unit, dtype=np.int64)
    expected[where.reshape(-1)] = np.arange(blocks * heads * unit)
    np.testing.assert_array_equal(_written_order(isa, dtype, cache_dtype, N, D, heads, blocks), expected,
                                  err_msg=f"{isa} kernel, {dtype}, cache {cache_dtype}, N={N}, D={D}")


def test_vllm_refuses_fp8_on_vec16() -> None:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    with pytest.raises(NotImplementedError, match="FP8 KV cache requires head_size divisible by 32"):
        _get_attn_isa(torch.float32, 32, 80, "fp8")


# ---- the adapter's choices and refusals (plain values) ---------------------------------
def test_kernel_is_read_from_the_layers_and_refused_when_unknown() -> None:
    assert resolved_isa({"model.layers.0.attn": ("CPU_ATTN", "vec16"),
                         "model.layers.1.attn": ("CPU_ATTN", "vec16")}) == "vec16"
    assert page_order_for("vec16", "float32", 32, 80) == "vllm_cpu_vec"
    with pytest.raises(UnsupportedVllmLayout, match="report the kernels 'vec', 'vec16'"):
        resolved_isa({"a": ("CPU_ATTN", "vec"), "b": ("CPU_ATTN", "vec16")})
    with pytest.raises(UnsupportedVllmLayout, match="report the kernels None"):
        resolved_isa({"a": ("CPU_ATTN", None)})
    with pytest.raises(UnsupportedVllmLayout, match=r"\['CPU_MLA'\] backend"):
        resolved_isa({"a": ("CPU_MLA", "vec")})
    with pytest.raises(UnsupportedVllmLayout, match="'rvv' kernel layout for dtype float32, block size 32"):
        page_order_for("rvv", "float32", 32, 64)


def test_cache_dtype_maps_to_a_kv_dtype_or_is_refused() -> None:
    assert kv_dtype_for("auto", "bfloat16") == "bfloat16"
    assert kv_dtype_for("fp8", "float32") == kv_dtype_for("fp8_e4m3", "bfloat16") == "fp8_e4m3"
    assert kv_dtype_for("fp8_e5m2", "float32") == "fp8_e5m2"
    with pytest.raises(UnsupportedVllmLayout, match="kv_cache_dtype 'fp8_inc' is not supported"):
        kv_dtype_for("fp8_inc", "float32")
    attention = GroupInfo("attention", ("model.layers.0.attn",), "torch.uint8", num_kv_heads=2, head_dim=64,
                          block_size=32)
    (fp8,) = with_kv_dtype([attention], "fp8_e4m3")
    assert fp8.dtype == "fp8_e4m3"
    with pytest.raises(UnsupportedVllmLayout, match=r"has torch\.float32"):
        with_kv_dtype([GroupInfo("attention", ("model.layers.0.attn",), "torch.float32")], "fp8_e4m3")
    mamba = GroupInfo("mamba2", ("model.layers.1.mixer",), "float32")
    with pytest.raises(UnsupportedVllmLayout, match=r"attention-only models; this model also has \['mamba2'\]"):
        with_kv_dtype([attention, mamba], "fp8_e4m3")


def test_fp8_views_are_uint8() -> None:
    from kvlink.integrations.vllm.layout import LayerTensor

    view = LayerTensor("model.layers.0.attn", 4096, (4, 2, 32, 128), (8192, 4096, 128, 1), 1, "torch.uint8")
    assert check_layer_tensors([view], num_kv_heads=2, block_size=32, head_dim=64, dtype="fp8_e4m3")[1] == [32768]
    as_fp32 = LayerTensor("model.layers.0.attn", 4096, (4, 2, 32, 128), (8192, 4096, 128, 1), 4, "float32")
    with pytest.raises(UnsupportedVllmLayout, match=r"expected dtype torch.uint8 \(1-byte fp8_e4m3\)"):
        check_layer_tensors([as_fp32], num_kv_heads=2, block_size=32, head_dim=64, dtype="fp8_e4m3")


# ---- the handshake compares cache dtype and scales ------------------------------------
def _payload(model: ModelSpec) -> tuple[HandshakePayload, WorkerGeometry]:
    geometry = build_worker_geometry(model, 1, 0, 32, 32, 4, packed_base_addrs(model, 1, 32, 32, 4, 1 << 20),
                                     page_order="vllm_cpu_vec")
    payload = HandshakePayload(version=PROTOCOL_VERSION, engine_id="p", tp_rank=0, tp_size=1,
                               compat_hash=model.compat_hash(), agent_name="p0", agent_metadata=b"",
                               geometry=encode_geometry(geometry), sent_time=0.0)
    return payload, geometry


def _model(dtype: str, scales: tuple[tuple[float, float], ...] = ()) -> ModelSpec:
    return ModelSpec("smollm2", 2, 64, dtype, (FullAttention(),), (0, 0), kv_scales=scales)


def test_handshake_names_both_cache_dtypes_and_both_scales() -> None:
    unit = ((1.0, 1.0), (1.0, 1.0))
    p_payload, _ = _payload(_model("fp8_e4m3", unit))
    _, d_fp8 = _payload(_model("fp8_e4m3", unit))
    assert check_payload(p_payload, d_fp8, "p").model == d_fp8.model
    _, d_fp32 = _payload(_model("float32"))
    with pytest.raises(IncompatibleLayout) as refused:
        check_payload(p_payload, d_fp32, "p")
    assert "dtype: P has 'fp8_e4m3', D has 'float32'" in str(refused.value)
    assert "P has (1.0, 1.0) on all 2 layers, D has none (unquantized cache)" in str(refused.value)
    _, d_scaled = _payload(_model("fp8_e4m3", ((1.0, 1.0), (0.5, 1.0))))
    with pytest.raises(IncompatibleLayout, match=re.escape(
            "P has (1.0, 1.0) on all 2 layers, D has [(1.0, 1.0), (0.5, 1.0)]")):
        check_payload(p_payload, d_scaled, "p")


def test_kv_scales_travel_and_leave_unquantized_hashes_alone() -> None:
    plain = _model("float32")
    assert "kv_scales" not in plain.to_dict()
    scaled = _model("fp8_e4m3", ((1.0, 2.0), (0.25, 1.0)))
    assert ModelSpec.from_dict(scaled.to_dict()) == scaled
    assert scaled.compat_hash() != _model("fp8_e4m3").compat_hash()
    for bad in ([[1.0]], [["1", 1.0]], [[1.0, 1e999], [1.0, 1.0]], [[True, 1.0], [1.0, 1.0]]):
        with pytest.raises(ValueError, match="kv_scales"):
            ModelSpec.from_dict({**scaled.to_dict(), "kv_scales": bad})
    with pytest.raises(ValueError, match="kv_scales has 1"):
        _model("fp8_e4m3", ((1.0, 1.0),))
    with pytest.raises(ValueError, match="finite positive"):
        _model("fp8_e4m3", ((1.0, 0.0), (1.0, 1.0)))


# ---- real vLLM P → D ----------------------------------------------------------------------
SENTENCE = "The quick brown fox number {} jumps over the lazy dog near the river bank."
# ~9, ~100 and ~330 tokens: inside one block of 32, past several, past two blocks of 128
PROMPTS = ["The last keeper of the lighthouse was",
           " ".join(SENTENCE.format(i) for i in range(6)),
           "Once upon a time, " + " ".join(SENTENCE.format(i) for i in range(100, 120))]
DIRECTIONS = ("32->128", "128->32")
TAGGED = [f"({d}) {p}" for d in DIRECTIONS for p in PROMPTS]  # no shared first blocks on D
FP8_ARGS = ("--kv-cache-dtype", "fp8")
SMOLLM2_FP8_BYTES_PER_TOKEN = 30 * 3 * 2 * 64 * 1  # 30 layers, 3 KV heads, K and V of 64, 1 byte


def _kernel_logged(server: Service) -> str:
    found = re.findall(r"kvlink: vLLM's CPU_ATTN attention runs the '(\w+)' kernel \(KV cache (\w+)",
                       server.log_path.read_text(errors="replace"))
    assert found, f"{server.name}: no kernel line in {server.log_path}"
    return "{} ({})".format(*found[-1])


def _d_bytes(server: Service) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:kvlink_bytes_transferred_sum"))


def _pd(p: Service, d: Service, prompt: str) -> tuple[list[int], int]:
    """D's greedy token ids after P prefilled `prompt`, and the prompt's token count."""
    model = served_model(p.url)
    prefill = httpx.post(p.url + "/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True}})
    prefill.raise_for_status()
    body: dict[str, Any] = prefill.json()
    resp = complete(d.url, model, prompt, kv_transfer_params=body["kv_transfer_params"])
    return token_ids(resp), int(body["usage"]["prompt_tokens"])


def _pair(p_and_d: list[Service], direction: str) -> tuple[Service, Service]:
    block32, block128 = p_and_d
    return (block32, block128) if direction == "32->128" else (block128, block32)


@pytest.mark.slow
class TestVec16:
    """Head size 80 in fp32: vLLM runs `vec16` on both sides; blocks 32 and 128 differ."""

    @pytest.fixture(scope="class")
    @classmethod
    def model_dir(cls) -> Path:
        return tiny_llama_head80_dir()

    @pytest.fixture(scope="class")
    @classmethod
    def pair_specs(cls, vllm_servers: VllmServers, model_dir: Path) -> list[VllmServerSpec]:
        secret = new_secret()
        return [vllm_servers.kvlink_spec(model_dir, f"head80-block{block}", core, secret, block_size=block)
                for block, core in ((32, "0"), (128, "1"))]

    @pytest.fixture(scope="class")
    @classmethod
    def references(cls, vllm_servers: VllmServers, model_dir: Path,
                   pair_specs: list[VllmServerSpec]) -> dict[str, list[int]]:
        spec = VllmServerSpec(model=model_dir, port=vllm_servers.http_port(), cores="0", enforce_eager=True,
                              name="head80-colocated")
        refs = vllm_servers.colocated_token_ids(spec, TAGGED, alongside=pair_specs)
        for direction in DIRECTIONS:  # a wrong KV must show as another answer
            answers = {tuple(refs[f"({direction}) {p}"]) for p in PROMPTS}
            assert len(answers) == len(PROMPTS), "greedy text must follow the prompt"
        return refs

    @pytest.fixture(scope="class")
    @classmethod
    def servers(cls, vllm_servers: VllmServers, pair_specs: list[VllmServerSpec],
                references: dict[str, list[int]]) -> Iterator[list[Service]]:
        yield from vllm_servers.serve(*pair_specs)

    def test_both_servers_run_vec16(self, servers: list[Service]) -> None:
        assert [_kernel_logged(s) for s in servers] == ["vec16 (float32)"] * 2

    @pytest.mark.parametrize("direction", DIRECTIONS)
    @pytest.mark.parametrize("index", range(len(PROMPTS)))
    def test_vec16_between_block_sizes_equals_colocated(self, servers: list[Service],
                                                        references: dict[str, list[int]],
                                                        direction: str, index: int) -> None:
        prompt = f"({direction}) {PROMPTS[index]}"
        got, _ = _pd(*_pair(servers, direction), prompt)
        assert got == references[prompt]


@pytest.mark.slow
class TestFp8:
    """SmolLM2 with an fp8 (e4m3) KV cache: bytes move as they are, 1 per element. fp32 runs
    the `vec` kernel; bf16 runs `amx` where the CPU has AMX tiles (1-byte tiles then)."""

    @pytest.fixture(scope="class", params=["float32", "bfloat16"])
    @classmethod
    def model_dtype(cls, request: pytest.FixtureRequest) -> str:
        return str(request.param)

    @pytest.fixture(scope="class")
    @classmethod
    def pair_specs(cls, vllm_servers: VllmServers, smollm2_dir: Path, model_dtype: str) -> list[VllmServerSpec]:
        secret = new_secret()
        return [vllm_servers.kvlink_spec(smollm2_dir, f"smollm2-{model_dtype}-fp8-block{block}", core, secret,
                                         block_size=block, dtype=model_dtype, args=list(FP8_ARGS))
                for block, core in ((32, "0"), (128, "1"))]

    @pytest.fixture(scope="class")
    @classmethod
    def references(cls, vllm_servers: VllmServers, smollm2_dir: Path, model_dtype: str,
                   pair_specs: list[VllmServerSpec]) -> dict[str, list[int]]:
        spec = VllmServerSpec(model=smollm2_dir, port=vllm_servers.http_port(), cores="0", enforce_eager=True,
                              dtype=model_dtype, args=list(FP8_ARGS), name=f"smollm2-{model_dtype}-fp8-colocated")
        return vllm_servers.colocated_token_ids(spec, TAGGED, alongside=pair_specs)

    @pytest.fixture(scope="class")
    @classmethod
    def servers(cls, vllm_servers: VllmServers, pair_specs: list[VllmServerSpec],
                references: dict[str, list[int]]) -> Iterator[list[Service]]:
        yield from vllm_servers.serve(*pair_specs)

    def test_both_servers_report_their_kernel_and_scales(self, servers: list[Service], model_dtype: str) -> None:
        kernel = "amx" if model_dtype == "bfloat16" and AMX else "vec"
        assert [_kernel_logged(s) for s in servers] == [f"{kernel} (fp8_e4m3)"] * 2
        for server in servers:
            assert "k/v scales [(1.0, 1.0)]" in server.log_path.read_text(errors="replace")

    @pytest.mark.parametrize("direction", DIRECTIONS)
    @pytest.mark.parametrize("index", range(len(PROMPTS)))
    def test_fp8_between_block_sizes_equals_colocated(self, servers: list[Service],
                                                      references: dict[str, list[int]],
                                                      direction: str, index: int) -> None:
        prompt = f"({direction}) {PROMPTS[index]}"
        p, d = _pair(servers, direction)
        before = _d_bytes(d)
        got, tokens = _pd(p, d, prompt)
        assert got == references[prompt]
        p_block = 32 if direction == "32->128" else 128
        # staged: whole P blocks of the N-1 tokens P computed, one byte per element
        want = -(-(tokens - 1) // p_block) * p_block * SMOLLM2_FP8_BYTES_PER_TOKEN
        deadline = time.monotonic() + 5  # stats reach the API server with the next engine step
        while _d_bytes(d) - before != want and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _d_bytes(d) - before == want
