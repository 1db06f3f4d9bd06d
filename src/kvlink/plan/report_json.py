"""`kvlink plan --json` as a stream: the report's JSON text piece by piece, never the whole document.

Memory stays that of one D rank's plan, whatever the number of transfers listed: the
header, then each D rank's figures and its transfers in batches. The text is the
document `json.dumps(plan_report(..., with_transfers=True))` describes (docs/plan-json.md).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from kvlink.layout.spec import ModelSpec
from kvlink.plan.report import (
    EngineConfig,
    Sample,
    Transfers,
    plan_rank,
    prepare_sample,
    report_header,
)

# Transfers turned into text at once: a few hundred KiB of it.
BATCH = 4096
TRANSFER = ('{{"src_rank": {}, "src_region": {}, "src_offset": {}, "dst_region": {}, '
            '"dst_offset": {}, "length": {}}}')


def plan_json(model: ModelSpec, p: EngineConfig, d: EngineConfig, prompt_tokens: int,
              d_computed_tokens: int = 0, scatter_seed: int | None = None) -> Iterator[str]:
    """Check everything now (raising as `plan_report` does, before any text), then return the
    document's text as an iterator of pieces: write each as it comes."""
    return _pieces(prepare_sample(model, p, d, prompt_tokens, d_computed_tokens, scatter_seed))


def _members(fields: dict[str, Any]) -> str:
    return ", ".join(f"{json.dumps(key)}: {json.dumps(value)}" for key, value in fields.items())


def _pieces(sample: Sample) -> Iterator[str]:
    yield "{" + "".join(f"\n {json.dumps(key)}: {json.dumps(value)}," for key, value in
                        report_header(sample).items())
    yield '\n "d_ranks": ['
    for index, reader in enumerate(sample.d_workers):
        entry, reads = plan_rank(sample, reader)
        yield ("," if index else "") + "\n  {" + _members(entry) + ', "transfers": ['
        first = True
        for read in reads:
            for start in range(0, len(read.length), BATCH):
                yield ("" if first else ",") + ",".join(_batch(read, start))
                first = False
        yield "\n  ]}"
    yield "\n ]\n}\n"


def _batch(read: Transfers, start: int) -> Iterator[str]:
    end = start + BATCH
    columns = (read.src_region[start:end].tolist(), read.src_offset[start:end].tolist(),
               read.dst_region[start:end].tolist(), read.dst_offset[start:end].tolist(),
               read.length[start:end].tolist())
    for row in zip(*columns, strict=True):
        yield "\n   " + TRANSFER.format(read.src_rank, *row)
