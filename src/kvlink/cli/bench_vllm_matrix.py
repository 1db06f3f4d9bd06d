"""`kvlink bench vllm-matrix`: connectors through docs/vllm.md's support-matrix cases in vLLM."""

from __future__ import annotations

import argparse
import json
import signal
from pathlib import Path
from typing import Any

from kvlink.cli.argtypes import json_object, name_subset, output_dir
from kvlink.cli.ranges import ranged
from kvlink.layout.limits import SECONDS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvlink.bench.vllm_matrix import CELLS, CONNECTORS, FAMILIES

    families = tuple(FAMILIES)
    parser.add_argument("--connectors", type=lambda t: name_subset(t, CONNECTORS), default=CONNECTORS,
                        help="comma-separated: nixl,kvlink (default both)")
    parser.add_argument("--families", type=lambda t: name_subset(t, families), default=families,
                        help="comma-separated families (default every one): " + ", ".join(
                            f"{f.name} ({f.about})" for f in FAMILIES.values()))
    parser.add_argument("--cells", default=None, metavar="N,N,...",
                        help=f"only these cells, by number in --list order (1-{len(CELLS)}), run in the order given")
    parser.add_argument("--list", action="store_true", help="list the cells and exit")
    parser.add_argument("--deadline-s", type=ranged(SECONDS), default=60.0,
                        help="per request; past it the cell counts as a hang (default 60)")
    parser.add_argument("--nixl-extra", type=json_object, default={}, metavar="JSON",
                        help="NixlConnector's kv_connector_extra_config")
    parser.add_argument("--out-dir", type=output_dir, default=Path("bench-results/vllm-matrix"),
                        help="JSON, markdown and server logs go here")


def _chosen_cells(args: argparse.Namespace) -> tuple[object, ...]:
    from kvlink.bench.vllm_matrix import CELLS

    numbered = list(enumerate(CELLS, 1))
    if args.cells:
        try:
            wanted = list(dict.fromkeys(int(x) for x in args.cells.split(",") if x.strip()))
        except ValueError:
            raise ValueError(f"--cells takes numbers, got {args.cells!r}") from None
        if not wanted or not set(wanted) <= {n for n, _ in numbered}:
            raise ValueError(f"--cells takes numbers 1-{len(CELLS)}, got {args.cells!r}")
        numbered = [(n, CELLS[n - 1]) for n in wanted]  # in the order given
    return tuple(c for _, c in numbered if c.family in args.families)


def run(args: argparse.Namespace) -> int:
    from kvlink.bench.vllm_matrix import CELLS, MatrixConfig, markdown, run_matrix

    if args.list:
        for number, cell in enumerate(CELLS, 1):
            print(f"{number:3d}  {cell.key}  [{cell.kind}; P {cell.p.label()}; D {cell.d.label()}]")
        return 0
    try:
        cells = _chosen_cells(args)
    except ValueError as error:
        print(f"kvlink bench vllm-matrix: error: {error}")
        return 2
    if not cells:
        print("kvlink bench vllm-matrix: error: no cell matches --families/--cells")
        return 2
    out_dir: Path = args.out_dir
    config = MatrixConfig(cells=cells, connectors=args.connectors, deadline_s=args.deadline_s,  # type: ignore[arg-type]
                          log_dir=(out_dir / "logs").resolve(), nixl_extra=dict(args.nixl_extra))

    def interrupted(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, interrupted)
    out_dir.mkdir(parents=True, exist_ok=True)

    def save(report: dict[str, Any]) -> None:
        (out_dir / "matrix.json").write_text(json.dumps(report, indent=2, default=str))
        (out_dir / "matrix.md").write_text(markdown(report))

    try:
        report = run_matrix(config, progress=lambda line: print(line, flush=True), on_cell=save)
    except KeyboardInterrupt:
        print(f"interrupted; every process started was stopped; the cells done are in {out_dir / 'matrix.md'}")
        return 130
    save(report)
    print()
    print(markdown(report))
    print(f"wrote {out_dir / 'matrix.json'} and {out_dir / 'matrix.md'}")
    return 0
