"""What `kvlink bench vllm` runs: its cases (connector x P block x D block), their settings,
and the reference prompts whose answers are compared with a colocated vLLM's."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CONNECTORS = ("nixl", "kvlink")
SAME_BLOCKS: tuple[tuple[int, int], ...] = ((128, 128),)
MIXED_BLOCKS: tuple[tuple[int, int], ...] = ((32, 128), (128, 32))


@dataclass(frozen=True)
class Case:
    connector: str
    prefill_block: int
    decode_block: int

    @property
    def name(self) -> str:
        return f"{self.connector} P{self.prefill_block}->D{self.decode_block}"

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

    def cases(self) -> list[Case]:
        """Same-block cases first (every connector), then the heterogeneous ones."""
        return [Case(c, p, d) for (p, d) in self.block_pairs for c in self.connectors]


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
