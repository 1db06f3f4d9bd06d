"""Colocated engine: generation equals a no-paging reference, survives preemption, frees every block."""

from __future__ import annotations

import pytest
import torch

from kvlink.engine.engine import LLMEngine
from kvlink.engine.kv_cache import allocate_kv_caches
from kvlink.engine.model.tiny_hybrid import TinyHybridModel
from kvlink.engine.request import RequestOutput, SamplingParams
from kvlink.layout.spec import FullAttention, ModelSpec

VOCAB, BLOCK, KERNEL_BLOCK = 512, 8, 4
ATTENTION_ONLY = ModelSpec("tiny-attn", 4, 32, "float32", (FullAttention(),), (0, 0))


@pytest.fixture(scope="module")
def hybrid() -> TinyHybridModel:
    return TinyHybridModel(vocab_size=VOCAB, seed=7, eos_token_ids=())


@pytest.fixture(scope="module")
def attention() -> TinyHybridModel:
    return TinyHybridModel(ATTENTION_ONLY, vocab_size=VOCAB, seed=8, eos_token_ids=())


def prompt(seed: int, length: int) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference_greedy(model: TinyHybridModel, tokens: list[int], max_tokens: int) -> list[int]:
    """Recompute the whole sequence from scratch for every token, in fresh contiguous caches."""
    out: list[int] = []
    for _ in range(max_tokens):
        sequence = tokens + out
        blocks = -(-len(sequence) // BLOCK)
        caches = allocate_kv_caches(model.spec, 1, BLOCK, KERNEL_BLOCK, blocks)
        tables = [torch.arange(blocks) for _ in model.spec.groups]
        logits = model.forward(torch.tensor(sequence), 0, tables, caches, block_size=BLOCK)
        out.append(int(torch.argmax(logits[-1])))
    return out


def run_all(engine: LLMEngine, max_steps: int = 500) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
        engine.check_integrity()
    assert not engine.has_unfinished(), "engine did not finish"
    assert engine.stats()["free_blocks"] == [engine.num_blocks] * len(engine.pools)
    return outputs


def tokens_of(outputs: list[RequestOutput]) -> list[int]:
    assert outputs[-1].finished and all(not o.finished for o in outputs[:-1])
    return [t for o in outputs for t in o.new_token_ids]


def test_batched_greedy_equals_no_paging_reference(hybrid: TinyHybridModel) -> None:
    engine = LLMEngine(hybrid, num_blocks=32, block_size=BLOCK, kernel_block_size=KERNEL_BLOCK)
    prompts = {f"r{i}": prompt(i, 5 + 4 * i) for i in range(3)}
    for request_id, tokens in prompts.items():
        engine.add_request(request_id, tokens, SamplingParams(max_tokens=6))
    outputs = run_all(engine)
    for request_id, tokens in prompts.items():
        assert tokens_of(outputs[request_id]) == reference_greedy(hybrid, tokens, 6)
        assert outputs[request_id][-1].finish_reason == "length"


def test_preemption_requeues_and_output_is_unchanged(hybrid: TinyHybridModel) -> None:
    # Each request grows to 3 blocks; 5 blocks cannot hold two of them, so one is preempted.
    engine = LLMEngine(hybrid, num_blocks=5, block_size=BLOCK, kernel_block_size=KERNEL_BLOCK)
    prompts = {"a": prompt(10, 7), "b": prompt(11, 7)}
    for request_id, tokens in prompts.items():
        engine.add_request(request_id, tokens, SamplingParams(max_tokens=12))
    preempted = False
    outputs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
        preempted |= engine.stats()["running"] < 2 and engine.stats()["waiting"] > 0
        engine.check_integrity()
    assert preempted
    assert engine.stats()["free_blocks"] == [5, 5]
    for request_id, tokens in prompts.items():
        assert tokens_of(outputs[request_id]) == reference_greedy(hybrid, tokens, 12)


def test_prefix_cache_hit_skips_compute_and_keeps_output(attention: TinyHybridModel) -> None:
    engine = LLMEngine(attention, num_blocks=16, block_size=BLOCK, kernel_block_size=KERNEL_BLOCK)
    shared = prompt(20, 17)
    engine.add_request("first", shared, SamplingParams(max_tokens=2))
    run_all(engine)
    fed: list[int] = []
    forward = attention.forward

    def counting_forward(input_ids: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        fed.append(int(input_ids.shape[0]))
        return forward(input_ids, *args, **kwargs)  # type: ignore[arg-type]

    engine.runner.model = type("Spy", (), {"forward": staticmethod(counting_forward)})()  # type: ignore[assignment]
    second = [*shared[:16], 3, 4]
    engine.add_request("second", second, SamplingParams(max_tokens=3))
    outputs = run_all(engine)
    assert fed[0] == 2, "the two cached blocks (16 tokens) should not be recomputed"
    assert tokens_of(outputs["second"]) == reference_greedy(attention, second, 3)


def test_seeded_sampling_is_reproducible(hybrid: TinyHybridModel) -> None:
    def generate(seed: int) -> list[int]:
        engine = LLMEngine(hybrid, num_blocks=8, block_size=BLOCK, kernel_block_size=KERNEL_BLOCK)
        engine.add_request("s", prompt(30, 6), SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=seed))
        return tokens_of(run_all(engine)["s"])

    assert generate(1) == generate(1)
    assert generate(1) != generate(2)


def test_stop_token_and_abort(hybrid: TinyHybridModel) -> None:
    tokens = prompt(40, 6)
    first = reference_greedy(hybrid, tokens, 1)[0]
    engine = LLMEngine(hybrid, num_blocks=8, block_size=BLOCK, kernel_block_size=KERNEL_BLOCK)
    engine.add_request("stops", tokens, SamplingParams(max_tokens=5, stop_token_ids=(first,)))
    engine.add_request("aborted", prompt(41, 6), SamplingParams(max_tokens=50))
    first_step = engine.step()
    assert engine.abort("aborted") and not engine.abort("unknown")
    outputs = run_all(engine)
    outputs["stops"] = [o for o in first_step if o.request_id == "stops"]
    assert outputs["stops"][-1].finish_reason == "stop" and tokens_of(outputs["stops"]) == [first]
    assert outputs["aborted"][-1].finish_reason == "abort"


def test_prompt_larger_than_the_pool_fails_clearly(hybrid: TinyHybridModel) -> None:
    engine = LLMEngine(hybrid, num_blocks=2, block_size=BLOCK, kernel_block_size=KERNEL_BLOCK)
    engine.add_request("huge", prompt(50, 40))
    engine.add_request("fits", prompt(51, 4), SamplingParams(max_tokens=2))
    outputs = run_all(engine)
    assert outputs["huge"][-1].finish_reason == "error"
    assert "raise num_blocks" in (outputs["huge"][-1].error or "")
    assert len(tokens_of(outputs["fits"])) == 2



def test_max_model_len_refuses_requests_up_front(hybrid: TinyHybridModel) -> None:
    engine = LLMEngine(hybrid, 8, BLOCK, KERNEL_BLOCK, max_model_len=16)
    with pytest.raises(ValueError, match="exceed max_model_len 16"):
        engine.add_request("long", prompt(60, 10), SamplingParams(max_tokens=7))
    engine.add_request("ok", prompt(60, 10), SamplingParams(max_tokens=6))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("ok", prompt(60, 3))
    assert len(tokens_of(run_all(engine)["ok"])) == 6


@pytest.mark.parametrize("flag", [True, "yes", 1, None])
def test_a_colocated_engine_refuses_to_prefill_for_a_remote_decoder(hybrid: TinyHybridModel, flag: object) -> None:
    """Without a KV connector nothing keeps a request's KV for D: a `do_remote_decode` request
    (whatever its flag's value, bar False) is refused, not answered with an empty completion
    and no params; `do_remote_decode: false` and other params are served as usual."""
    engine = LLMEngine(hybrid, 8, BLOCK, KERNEL_BLOCK)
    with pytest.raises(ValueError, match="no KV connector"):
        engine.add_request("p", prompt(70, 6), SamplingParams(max_tokens=2), {"do_remote_decode": flag})
    engine.add_request("plain", prompt(70, 6), SamplingParams(max_tokens=2), {"do_remote_decode": False})
    engine.add_request("other", prompt(71, 6), SamplingParams(max_tokens=2), {"something": 1})
    outputs = run_all(engine)
    assert len(tokens_of(outputs["plain"])) == 2 and len(tokens_of(outputs["other"])) == 2
    assert "p" not in outputs


@pytest.mark.parametrize("flag", [True, "yes", 1, None])
def test_a_colocated_engine_refuses_to_decode_from_a_remote_prefill(hybrid: TinyHybridModel, flag: object) -> None:
    """A colocated engine given P's params (a router pointed at it as a decoder) refuses them:
    it would prefill the prompt itself and never tell P, which would hold the blocks for its
    whole lease."""
    engine = LLMEngine(hybrid, 8, BLOCK, KERNEL_BLOCK)
    params = {"do_remote_prefill": flag, "remote_engine_id": "P", "remote_block_ids": [[0]]}
    with pytest.raises(ValueError, match=r"do_remote_prefill .*no KV connector"):
        engine.add_request("d", prompt(70, 6), SamplingParams(max_tokens=2), params)
    engine.add_request("plain", prompt(70, 6), SamplingParams(max_tokens=2), {"do_remote_prefill": False})
    outputs = run_all(engine)
    assert len(tokens_of(outputs["plain"])) == 2 and "d" not in outputs


@pytest.mark.parametrize("chunk", [1, 3, 8, 13])
def test_chunked_prefill_equals_the_reference_and_decodes_between_chunks(hybrid: TinyHybridModel,
                                                                         chunk: int) -> None:
    """`prefill_chunk`: a long prompt prefills `chunk` tokens per step (the SSM state and the
    paged KV carry over between chunks) while a short request decodes in the same steps;
    greedy output equals the no-paging reference, and nothing is sampled from a chunk."""
    engine = LLMEngine(hybrid, num_blocks=32, block_size=BLOCK, kernel_block_size=KERNEL_BLOCK,
                       prefill_chunk=chunk)
    fed: list[tuple[str, int, int]] = []
    run = engine.runner.run

    def spying_run(runs: list) -> dict[str, int]:  # type: ignore[type-arg]
        fed.extend((r.request.request_id, r.start_pos, r.num_tokens) for r in runs)
        return run(runs)

    engine.runner.run = spying_run  # type: ignore[method-assign]
    prompts = {"short": prompt(30, 2), "long": prompt(31, 29)}
    for request_id, tokens in prompts.items():
        engine.add_request(request_id, tokens, SamplingParams(max_tokens=5))
    outputs = run_all(engine)
    for request_id, tokens in prompts.items():
        assert tokens_of(outputs[request_id]) == reference_greedy(hybrid, tokens, 5)
    long_runs = [(start, n) for rid, start, n in fed if rid == "long"]
    prefill = [(start, n) for start, n in long_runs if start < 29]
    assert all(n <= chunk for _, n in prefill) and sum(n for _, n in prefill) == 29
    assert [start for start, _ in prefill] == sorted({start for start, _ in prefill})  # in order, no repeat
    if chunk < 29:  # the short request decoded while the long one was still prefilling
        last_chunk_step = max(i for i, (rid, start, _) in enumerate(fed) if rid == "long" and start < 29)
        assert any(rid == "short" for rid, _, _ in fed[:last_chunk_step])
    assert len(outputs["long"]) == 5, "a chunk produced an output"


def test_prefill_chunk_must_not_be_negative(hybrid: TinyHybridModel) -> None:
    with pytest.raises(ValueError, match="prefill_chunk"):
        LLMEngine(hybrid, num_blocks=8, block_size=BLOCK, kernel_block_size=KERNEL_BLOCK, prefill_chunk=-1)
