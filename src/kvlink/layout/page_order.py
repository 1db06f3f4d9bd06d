"""Element orders inside one head's unit of an attention page ("page orders").

An attention page is `[heads, N, 2*D]` elements (N = kernel block size, D = head dim);
heads are outermost in every order, so a head's unit of `N * 2 * D` elements is one
contiguous range. Orders differ only inside a unit:

* `token_major` (kvlink's own): token n's K at `n*2D + d`, its V at `n*2D + D + d`.
* `vllm_cpu_vec`: K part then V part, `N*D` elements each. K is transposed `[D][N]`
  (element `d*N + n`), V is token-major `[N][D]` (element `N*D + n*D + d`). vLLM's `vec`
  and `vec16` kernels both store this order, for any N (vec16 serves head dims that are not
  multiples of 32, such as 80, and block sizes that are not).
* `vllm_cpu_amx`: K is `[N/16][D/2][16][2]`, V is `[D/16][N/2][16][2]` after the K part,
  for 2-byte elements (bfloat16) and for 1-byte ones (fp8 KV caches) alike.

Orders place elements, not bytes, so one order serves every dtype: an element is
`dtype_bytes` contiguous bytes (4, 2, or 1 for an fp8 cache, whose bytes move as they are).

`unit_segments` describes an order as segments of token granules, which is all the
planner needs: a run of whole granules is one contiguous byte range per segment.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import lcm

import numpy as np
import numpy.typing as npt

from kvlink.layout.spec import DTYPE_BYTES

PAGE_ORDERS = ("token_major", "vllm_cpu_vec", "vllm_cpu_amx")
DEFAULT_PAGE_ORDER = "token_major"

IntLike = int | npt.NDArray[np.int64]

_GRANULES = {"token_major": (1,), "vllm_cpu_vec": (1,), "vllm_cpu_amx": (16, 2)}


@dataclass(frozen=True)
class Segment:
    """Part of a head's unit holding tokens in consecutive granules.

    Granule k (tokens `[k*granule_tokens, (k+1)*granule_tokens)`) is `granule_bytes`
    contiguous bytes at `offset_bytes + k*granule_bytes` from the unit start.
    """

    offset_bytes: int
    granule_tokens: int
    granule_bytes: int


def _known(order: str) -> None:
    if order not in PAGE_ORDERS:
        raise ValueError(f"unknown page order {order!r}; known orders: {', '.join(PAGE_ORDERS)}")


def element_index(order: str, N: int, D: int, part: IntLike, n: IntLike, d: IntLike) -> npt.NDArray[np.int64]:
    """Element offset inside one head's unit of element (part, token n, dim d); part 0 = K, 1 = V.

    Vectorized: `part`, `n` and `d` broadcast against each other.
    """
    _known(order)
    p, t, k = (np.asarray(x, dtype=np.int64) for x in (part, n, d))
    if order == "token_major":
        out = t * 2 * D + p * D + k
    elif order == "vllm_cpu_vec":
        out = np.where(p == 0, k * N + t, N * D + t * D + k)
    else:
        key = (t // 16) * 16 * D + (k // 2) * 32 + (t % 16) * 2 + k % 2
        value = N * D + (k // 16) * 16 * N + (t // 2) * 32 + (k % 16) * 2 + t % 2
        out = np.where(p == 0, key, value)
    return np.asarray(out, dtype=np.int64)


def unit_segments(order: str, N: int, D: int, dtype_bytes: int) -> tuple[Segment, ...]:
    """The segments of one head's unit of `N` tokens, `D` dims, `dtype_bytes` per element."""
    _known(order)
    e = dtype_bytes
    if order == "token_major":
        return (Segment(0, 1, 2 * D * e),)
    if order == "vllm_cpu_vec":
        return (*(Segment(d * N * e, 1, e) for d in range(D)), Segment(N * D * e, 1, D * e))
    return (Segment(0, 16, 16 * D * e),
            *(Segment(N * D * e + g * 16 * N * e, 2, 32 * e) for g in range(D // 16)))


def min_chunk_tokens(order: str) -> int:
    """Smallest token chunk that is whole granules in every segment of `order`."""
    _known(order)
    return lcm(*_GRANULES[order])


def check_page_order(order: object, N: int, D: int, dtype: str) -> None:
    """ValueError unless `order` can lay out pages of `N` tokens, head dim `D`, in `dtype`."""
    if not isinstance(order, str):
        raise ValueError(f"page order must be a string, one of {', '.join(PAGE_ORDERS)}; got {order!r}")
    _known(order)
    if order == "vllm_cpu_amx":
        if DTYPE_BYTES.get(dtype) not in (1, 2):
            raise ValueError(f"page order 'vllm_cpu_amx' needs a 2-byte dtype (bfloat16) or an fp8 cache, "
                             f"got {dtype!r}")
        if N % 32 or D % 32:
            raise ValueError(f"page order 'vllm_cpu_amx' needs kernel block size and head dim to be "
                             f"multiples of 32, got kernel block size {N}, head dim {D}")
    for granule in _GRANULES[order]:
        if N % granule:
            raise ValueError(f"page order {order!r} stores tokens in granules of {granule}, which "
                             f"does not divide kernel block size {N}")
