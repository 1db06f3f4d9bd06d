"""One process, two real NIXL agents: a plan in a vLLM page order between unequal kernel
blocks moves exactly the right bytes (read back through D's geometry): bf16 in the vec order,
fp8 (1-byte) caches in the vec order at vLLM's vec16 shapes (head size 80, block 16) and in
the amx order."""

from __future__ import annotations

import time

import kvmem
import numpy as np
import pytest
import sim

from kvlink.layout.spec import FullAttention, ModelSpec
from kvlink.plan.transfer_plan import build_transfer_plan
from kvlink.transfer.agent import NixlAgent

pytestmark = pytest.mark.timeout(60)

CASES = [("vllm_cpu_vec", "bfloat16", 32, 32, 128), ("vllm_cpu_vec", "bfloat16", 32, 128, 32),
         ("vllm_cpu_vec", "fp8_e4m3", 80, 16, 32), ("vllm_cpu_vec", "fp8_e4m3", 80, 128, 16),
         ("vllm_cpu_amx", "fp8_e4m3", 32, 32, 128), ("vllm_cpu_amx", "fp8_e4m3", 64, 128, 32)]


@pytest.mark.parametrize(("order", "dtype", "head_dim", "p_kbs", "d_kbs"), CASES)
def test_vllm_page_order_read_between_unequal_kernel_blocks(order: str, dtype: str, head_dim: int,
                                                            p_kbs: int, d_kbs: int) -> None:
    shipped = 200
    model = ModelSpec("vllm", 2, head_dim, dtype, (FullAttention(),), (0, 0))
    p_blocks, d_blocks = -(-(shipped + 1) // p_kbs), -(-(shipped + 1) // d_kbs)
    p = kvmem.real_worker(model, 1, 0, p_kbs, p_kbs, p_blocks + 1, seed=1, page_order=order)
    d = kvmem.real_worker(model, 1, 0, d_kbs, d_kbs, d_blocks + 1, seed=2, page_order=order)
    rng = np.random.default_rng(3)
    logical = sim.make_logical(model, shipped, rng)
    p_ids = [rng.permutation(p_blocks + 1)[:p_blocks]]
    d_ids = [rng.permutation(d_blocks + 1)[:d_blocks]]
    tokens = [np.arange(shipped, dtype=np.int64)]
    sim.store(p, logical, p_ids, tokens)
    plan = build_transfer_plan(d.geometry, {0: p.geometry})
    (spec,) = plan.request_ids(d_ids, p_ids, shipped)
    source = plan.source(0)
    with NixlAgent(f"po-p-{order}-{dtype}-{p_kbs}") as p_agent, NixlAgent(f"po-d-{order}-{dtype}-{d_kbs}") as d_agent:
        for agent, mem in ((p_agent, p), (d_agent, d)):
            bases, sizes = kvmem.region_sizes(mem)
            agent.register_regions(list(zip(bases, sizes, strict=True)))
        name = d_agent.add_remote(p_agent.metadata())
        local = d_agent.prep_local(source.local_descs)
        remote = d_agent.prep_remote(name, source.remote_descs)
        transfer = d_agent.post("READ", local, spec.local_idx, remote, spec.remote_idx)
        end = time.monotonic() + 10
        while d_agent.poll(transfer) != "DONE":
            assert time.monotonic() < end, "READ not done in 10 s"
            p_agent.get_notifs()
        assert transfer.nbytes == spec.nbytes
        d_agent.release(transfer)
    got = sim.load(d, d_ids, tokens, 0)
    want = sim.expected_for(d, logical, tokens)
    for layer, rows in want.rows.items():
        np.testing.assert_array_equal(got.rows[layer], rows, err_msg=f"layer {layer}")
