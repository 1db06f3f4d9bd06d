"""The KV memory of one worker, allocated exactly as `layout.kv_tensor_specs` describes it."""

from __future__ import annotations

import torch

from kvlink.layout.spec import ModelSpec
from kvlink.layout.tensors import kv_tensor_specs

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def allocate_kv_caches(
    spec: ModelSpec, tp_size: int, block_size: int, kernel_block_size: int, num_blocks: int,
) -> list[torch.Tensor]:
    """One zeroed tensor per layer, in layer order; `num_blocks` counts logical blocks per group."""
    dtype = TORCH_DTYPES[spec.dtype]
    return [
        torch.zeros(t.shape, dtype=dtype)
        for t in kv_tensor_specs(spec, tp_size, block_size, kernel_block_size, num_blocks)
    ]


def register_with(caches: list[torch.Tensor]) -> tuple[list[int], list[int]]:
    """Base addresses and sizes in bytes, the arguments of `ConnectorWorker.register_kv_caches`."""
    return [t.data_ptr() for t in caches], [t.numel() * t.element_size() for t in caches]
