"""Local re-layout of attention pages between two kernel block sizes of one page order.

A page order (`kvlink.layout.page_order`) stores each part of a head's unit (K, V, or
both) as a small array in which one axis walks the tokens in granules. `token_axes`
names those arrays; `page_views` turns a stack of pages into numpy views of them, and
`copy_token_runs` copies runs of tokens from pages of N tokens into pages of M tokens
with one slice assignment per run and part (no per-element work, no temporary).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import numpy as np
import numpy.typing as npt

from kvlink.layout.page_order import _known

Pages = npt.NDArray[np.generic]
RunArray = npt.NDArray[np.int64]  # rows: (src page, src token, dst page, dst token, tokens)
RUN_FIELDS = 5


@dataclass(frozen=True)
class TokenAxis:
    """One part of a head's unit: `prod(shape)` elements from element `offset`, viewed as
    `shape`; index i on axis `axis` holds tokens `[i*granule, (i+1)*granule)`."""

    offset: int
    shape: tuple[int, ...]
    axis: int
    granule: int


def token_axes(order: str, N: int, D: int) -> tuple[TokenAxis, ...]:
    """The parts of one head's unit of `N` tokens and head dim `D` in page order `order`."""
    _known(order)
    if order == "token_major":
        return (TokenAxis(0, (N, 2 * D), 0, 1),)
    if order == "vllm_cpu_vec":
        return (TokenAxis(0, (D, N), 1, 1), TokenAxis(N * D, (N, D), 0, 1))
    return (TokenAxis(0, (N // 16, D // 2, 16, 2), 0, 16),
            TokenAxis(N * D, (D // 16, N // 2, 16, 2), 1, 2))


def run_granule(order: str) -> int:
    """Token runs of `copy_token_runs` must start and end on multiples of this."""
    return max(axis.granule for axis in token_axes(order, 32, 32))


def page_views(pages: Pages, order: str, N: int, D: int) -> list[Pages]:
    """Views `[..., page, unit, *axis.shape]` of `pages` (`[..., page, unit, 2*N*D]`), one per
    part of `token_axes`; ValueError if a view would need a copy (odd strides)."""
    if pages.shape[-1] != 2 * N * D:
        raise ValueError(f"pages hold units of {pages.shape[-1]} elements, expected 2*N*D = {2 * N * D}")
    views = []
    for axis in token_axes(order, N, D):
        part = pages[..., axis.offset: axis.offset + prod(axis.shape)].view()
        try:
            part.shape = (*part.shape[:-1], *axis.shape)  # raises instead of copying
        except AttributeError as exc:
            raise ValueError(f"pages of shape {pages.shape} and strides {pages.strides} cannot be "
                             f"viewed by token: {exc}") from None
        views.append(part)
    return views


def _index(lead: int, page: int, axis: TokenAxis, start: int, stop: int) -> tuple[int | slice, ...]:
    tail: list[int | slice] = [slice(None)] * len(axis.shape)
    tail[axis.axis] = slice(start // axis.granule, stop // axis.granule)
    return (*([slice(None)] * lead), page, slice(None), *tail)


def copy_token_runs(src: Pages, src_N: int, dst: Pages, dst_N: int, order: str, D: int,
                    runs: RunArray) -> None:
    """Copy token runs from pages `src` (`[..., page, unit, 2*src_N*D]`) into `dst` (same
    leading dims and units, `dst_N` tokens per page). Each row of `runs` is (src page,
    first src token, dst page, first dst token, tokens), all on `run_granule(order)`
    boundaries and inside both pages."""
    if src.shape[:-3] != dst.shape[:-3] or src.shape[-2] != dst.shape[-2] or src.dtype != dst.dtype:
        raise ValueError(f"source pages {src.shape} {src.dtype} and destination pages {dst.shape} "
                         f"{dst.dtype} differ in leading dims, units or dtype")
    runs = np.asarray(runs, dtype=np.int64).reshape(-1, RUN_FIELDS)
    granule = run_granule(order)
    if runs.size:
        sp, st, dp, dt, n = runs.T
        if (n <= 0).any() or ((np.stack([st, dt, n]) % granule) != 0).any():
            raise ValueError(f"token runs must be positive and on multiples of {granule} tokens")
        if (st < 0).any() or (dt < 0).any() or (st + n > src_N).any() or (dt + n > dst_N).any():
            raise ValueError("a token run leaves its page")
        if (sp < 0).any() or (sp >= src.shape[-3]).any() or (dp < 0).any() or (dp >= dst.shape[-3]).any():
            raise ValueError("a token run names a page outside the pages given")
    lead = src.ndim - 3
    axes_src, axes_dst = token_axes(order, src_N, D), token_axes(order, dst_N, D)
    views = list(zip(page_views(src, order, src_N, D), page_views(dst, order, dst_N, D),
                     axes_src, axes_dst, strict=True))
    for s_page, s_tok, d_page, d_tok, count in runs.tolist():
        for s_view, d_view, s_axis, d_axis in views:
            d_view[_index(lead, d_page, d_axis, d_tok, d_tok + count)] = \
                s_view[_index(lead, s_page, s_axis, s_tok, s_tok + count)]
