"""What `kvlink bench vllm` runs: its cases (connector x P block x D block), their settings,
and the reference prompts whose answers are compared with a colocated vLLM's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CONNECTORS = ("nixl", "kvlink")
SAME_BLOCKS: tuple[tuple[int, int], ...] = ((128, 128),)
MIXED_BLOCKS: tuple[tuple[int, int], ...] = ((32, 128), (128, 32))


@dataclass(frozen=True)
class Family:
    """A model family the bench can run: its tiny model (or SmolLM2), dtype, flags and block pairs."""

    name: str
    model: str  # a builder in kvlink.integrations.vllm.models
    dtype: str
    args: tuple[str, ...]
    same_blocks: tuple[tuple[int, int], ...]
    mixed_blocks: tuple[tuple[int, int], ...]
    about: str
    needs_amx: bool = False  # vLLM serves it only on a CPU with AMX tiles


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("dense", "smollm2_hf_dir", "float32", (), SAME_BLOCKS, MIXED_BLOCKS, "SmolLM2-135M fp32"),
    # Interleaved sliding window, hybrid allocator on: between block sizes through D's staging pages.
    Family("swa", "tiny_gemma3_dir", "float32", (), SAME_BLOCKS, MIXED_BLOCKS,
           "tiny Gemma-3-like: 3 sliding-window layers (window 64) + 1 global, fp32"),
    # CPU_MLA takes block 16 only; pinned so that a machine with AMX runs the same backend.
    Family("mla", "tiny_deepseek_mla_dir", "bfloat16", ("--attention-backend", "CPU_MLA"), ((16, 16),), (),
           "tiny DeepSeek-V2-like MLA (latent 512 + rope 64), bf16, CPU_MLA"),
    # AMX_MLA (CPUs with AMX tiles only): blocks of 32k tokens; prefix caching off, since with
    # it vLLM's own answers change with the path a prompt takes (docs/vllm.md, MLA models).
    Family("mla-amx", "tiny_deepseek_mla_dir", "bfloat16",
           ("--attention-backend", "AMX_MLA", "--no-enable-prefix-caching"), ((32, 32),), ((32, 128), (128, 32)),
           "tiny DeepSeek-V2-like MLA, bf16, AMX_MLA (needs a CPU with AMX tiles)", needs_amx=True),
    # vLLM 0.32's CPU build crashes on hybrid prompts past one block with prefix caching on.
    # Its least block is 64 (vLLM raises 32 to fit the Mamba state page).
    Family("hybrid", "tiny_granite_hybrid_dir", "float32", ("--no-enable-prefix-caching",), SAME_BLOCKS,
           ((64, 128), (128, 64)),
           "tiny GraniteMoeHybrid: 3 Mamba2 layers + 1 attention, fp32, vLLM's default SD conv state"),
    # vLLM's CPU GDN kernel runs bf16 only, and sizes the attention block itself (640 here).
    Family("gdn", "tiny_qwen3_next_dir", "bfloat16", ("--no-enable-prefix-caching",), SAME_BLOCKS, (),
           "tiny Qwen3-Next-like: 3 Gated DeltaNet layers + 1 attention, bf16 (fp32 recurrent state)"),
)}


def family_model_dir(family: Family) -> Path:
    """The family's model directory, built (seeded) on first use."""
    from kvlink.integrations.vllm import models

    build: Callable[[], Path] = getattr(models, family.model)
    return Path(build())


@dataclass(frozen=True)
class Case:
    connector: str
    prefill_block: int
    decode_block: int
    label: str = ""  # a NixlConnector setting's name, shown next to the connector

    @property
    def name(self) -> str:
        tag = f"{self.connector}[{self.label}]" if self.label else self.connector
        return f"{tag} P{self.prefill_block}->D{self.decode_block}"

    @property
    def blocks(self) -> str:
        return f"P{self.prefill_block}->D{self.decode_block}"


@dataclass(frozen=True)
class VllmBenchConfig:
    model_dir: Path
    num_prompts: int = 16
    input_len: int = 256
    output_len: int = 32
    concurrency: int = 2
    seed: int = 0
    connectors: tuple[str, ...] = CONNECTORS
    block_pairs: tuple[tuple[int, int], ...] = SAME_BLOCKS + MIXED_BLOCKS
    idle_s: float = 10.0
    startup_timeout_s: float = 240.0
    client_timeout_s: float = 900.0
    max_model_len: int = 2048
    reference_tokens: int = 32
    cores: tuple[int, int] = (0, 1)
    enforce_eager: bool = False
    verify_kv: str | None = None  # kvlink's KV integrity check (None: the connector's default)
    log_dir: Path = Path("bench-results/vllm/logs")
    family: str = "dense"
    dtype: str = "float32"
    server_args: tuple[str, ...] = ()
    # NixlConnector's settings beyond its defaults: kv_connector_extra_config keys, environment.
    nixl_extra: dict[str, Any] = field(default_factory=dict)
    nixl_env: dict[str, str] = field(default_factory=dict)
    nixl_label: str = ""

    def cases(self) -> list[Case]:
        """Same-block cases first (every connector), then the heterogeneous ones."""
        return [Case(c, p, d, self.nixl_label if c == "nixl" else "")
                for (p, d) in self.block_pairs for c in self.connectors]


def default_model_dir() -> Path:
    """SmolLM2-135M as an HF directory, from the vLLM integration (imported only when needed)."""
    from kvlink.integrations.vllm.models import smollm2_hf_dir

    path: Path = smollm2_hf_dir()
    return path


def reference_prompts() -> list[str]:
    """Six fixed prompts: two short, two over one 128-token block, two of ~600 tokens."""
    facts = [
        "The river that runs through the old town was once used to carry timber to the coast.",
        "In winter the market square fills with stalls selling roasted chestnuts and wool.",
        "A clockmaker on the north bridge repaired the cathedral bells after the great storm.",
        "Students from the university gather at the library steps every evening to argue.",
        "The lighthouse keeper kept a diary of every ship that passed for forty years.",
        "Farmers bring apples, pears and honey from the valley every Saturday morning.",
        "The museum holds a collection of maps drawn by sailors who never came home.",
        "At night the streets are quiet except for the bakers preparing the morning bread.",
    ]

    def story(sentences: int, offset: int) -> str:
        return " ".join(facts[(offset + i) % len(facts)] for i in range(sentences))

    return [
        "The capital of France is",
        "Write a short poem about the sea:\n",
        story(9, 0) + "\nQuestion: what did the clockmaker repair?\nAnswer:",
        story(12, 3) + "\nSummarise the text above in one sentence:",
        story(36, 1) + "\nWhat do the farmers bring?\nAnswer:",
        story(38, 5) + "\nList three places mentioned above:",
    ]
