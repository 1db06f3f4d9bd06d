"""`kvlink demo`: P, D, the proxy and a colocated instance on loopback; same prompts, same answers.

Each prompt goes through the proxy (P prefills, D loads the KV over NIXL and
decodes) and to the colocated instance, greedy. The answers are printed side by
side with the KV bytes moved and where the time to first token went. Exits 1 if
any P/D answer differs from the colocated one.
"""

from __future__ import annotations

import argparse
import textwrap
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvlink.cli.argtypes import output_dir
from kvlink.cli.ranges import ranged
from kvlink.engine.models import MODEL_NAMES
from kvlink.layout.limits import NUM_BLOCKS, TOKENS, TP, int_range

if TYPE_CHECKING:
    from kvlink.bench.serve_client import Answer

PASSAGE = (
    "The harbour town of Vellmar sits at the mouth of a cold green river. Its lighthouse was "
    "built two hundred years ago from grey stone carried down from the hills by ox cart, and "
    "for most of that time it was kept by the same family. The last keeper, a woman named "
    "Ilse Marrow, climbed the one hundred and twelve steps every evening at dusk to light the "
    "lamp, and every morning at dawn to put it out. She kept a logbook in which she wrote the "
    "weather, the ships that passed, and the birds that rested on the gallery rail. In winter "
    "storms the waves broke over the lower windows, and she would sit by the lamp all night, "
    "trimming the wick and listening to the glass hum in the wind. Fishermen said that as long "
    "as the Marrow light burned, no boat from Vellmar would be lost, and for forty years none "
    "was. When the harbour board replaced the lamp with an electric beacon that needed no "
    "keeper, Ilse moved to a small house by the fish market. She gave her logbooks to the town "
    "library, where children still read them on rainy afternoons, tracing the names of ships "
    "that sailed long before they were born. The beacon turns on by itself now, but on stormy "
    "nights people in Vellmar still look up at the tower and think of the woman who climbed "
    "the stairs. Every spring the town holds a small festival on the quay, with bread, smoked "
    "fish and music, and the children carry paper lanterns up the hill to the lighthouse door."
)

PROMPTS: tuple[tuple[str, str], ...] = (
    ("short", "What is the capital of France?"),
    ("long", f"Read this story:\n\n{PASSAGE}\n\nWho was the last keeper of the lighthouse, and "
             "what did she do every evening?"),
    ("shared prefix", f"Read this story:\n\n{PASSAGE}\n\nWhat happens in the town every spring?"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=MODEL_NAMES, default="smollm2-135m")
    parser.add_argument("--p-tp", type=ranged(TP), default=1, help="tensor-parallel ranks of P")
    parser.add_argument("--d-tp", type=ranged(TP), default=1, help="tensor-parallel ranks of D")
    parser.add_argument("--max-tokens", type=ranged(TOKENS), default=32)
    parser.add_argument("--num-blocks", type=ranged(NUM_BLOCKS), default=128)
    parser.add_argument("--log-dir", type=output_dir, default=None,
                        help="where the processes' logs go (default: a fresh temporary directory)")
    parser.add_argument("--width", type=ranged(int_range(40, 10_000)), default=100,
                        help="output width in characters")


def check_args(args: argparse.Namespace) -> None:
    """Refuse TP sizes the model cannot be split over before starting anything."""
    from kvlink.cli.serve_cmd import SERVED_SPECS
    from kvlink.plan.compat import side_problems

    spec = SERVED_SPECS.get(args.model)
    if spec is None:
        return
    problems = side_problems("--p-tp", spec, args.p_tp, 16, 16) + side_problems("--d-tp", spec, args.d_tp, 16, 16)
    if problems:
        raise ValueError(f"--model {args.model}: " + "; ".join(problems))


@dataclass
class Row:
    name: str
    pd_text: str
    colocated_text: str
    line: str

    @property
    def same(self) -> bool:
        return self.pd_text == self.colocated_text


def run(args: argparse.Namespace) -> int:
    import httpx

    from kvlink.bench.cluster import ClusterSpec, running_cluster
    from kvlink.bench.instance_state import tails
    from kvlink.bench.serve_client import ServeError, stream_chat

    started = time.monotonic()
    spec = ClusterSpec(model=args.model, prefill_tp=args.p_tp, decode_tp=args.d_tp,
                       num_blocks=args.num_blocks, colocated=True)
    print(f"kvlink demo: {args.model}, P tp={args.p_tp} -> D tp={args.d_tp}, greedy, "
          f"max_tokens={args.max_tokens}", flush=True)
    rows: list[Row] = []
    try:
        with running_cluster(spec, args.log_dir, progress=lambda s: print(s, flush=True)) as cluster:
            assert cluster.proxy is not None and cluster.colocated is not None
            print(f"all up after {time.monotonic() - started:.0f}s; proxy {cluster.proxy.url}, "
                  f"colocated {cluster.colocated.url}", flush=True)
            with httpx.Client(timeout=httpx.Timeout(120.0, connect=5.0)) as client:
                # One tiny request each first: the first forward of a process pays one-off costs.
                print("warming up (one 2-token request through the proxy and to colocated)", flush=True)
                for url in (cluster.proxy.url, cluster.colocated.url):
                    stream_chat(client, url, [{"role": "user", "content": "Hi"}], 2)
                print(flush=True)
                for index, (name, prompt) in enumerate(PROMPTS, 1):
                    messages = [{"role": "user", "content": prompt}]
                    try:
                        pd = stream_chat(client, cluster.proxy.url, messages, args.max_tokens)
                        colocated = stream_chat(client, cluster.colocated.url, messages, args.max_tokens)
                    except (ServeError, httpx.HTTPError) as error:
                        print(f"request failed: {error}\n{tails(cluster.services())}", flush=True)
                        return 1
                    row = Row(name, pd.text, colocated.text, _figures_line(pd, colocated))
                    rows.append(row)
                    print(_render(index, row, pd.prompt_tokens, args.width), flush=True)
    except KeyboardInterrupt:
        print("interrupted; every process was stopped", flush=True)
        return 130
    except (RuntimeError, TimeoutError) as error:
        print(f"kvlink demo: {error}", flush=True)
        return 1
    same = sum(row.same for row in rows)
    verdict = "every P/D answer equals the colocated one" if same == len(rows) else \
        f"{len(rows) - same} of {len(rows)} P/D answers differ from the colocated ones"
    print(f"{verdict}; {time.monotonic() - started:.0f}s in all, every process stopped", flush=True)
    return 0 if same == len(rows) else 1


def _figures_line(pd: Answer, colocated: Answer) -> str:
    split = pd.split()
    kv = "KV: none moved" if pd.kv_bytes is None else \
        f"KV moved {pd.kv_bytes / 2**20:.2f} MiB in {(pd.kv_transfer_s or 0) * 1e3:.1f} ms"
    parts = [kv, f"TTFT P/D {pd.ttft_s * 1e3:.0f} ms"]
    if split is not None:
        parts[-1] += (f" = P prefill {split['prefill_s'] * 1e3:.0f} + KV {split['kv_transfer_s'] * 1e3:.0f}"
                      f" + D first token {split['decode_s'] * 1e3:.0f} + HTTP/proxy {split['other_s'] * 1e3:.0f}")
    parts.append(f"colocated TTFT {colocated.ttft_s * 1e3:.0f} ms")
    return " | ".join(parts)


def _render(index: int, row: Row, prompt_tokens: int, width: int) -> str:
    column = max(30, (width - 3) // 2)

    def cell(text: str) -> list[str]:
        lines = textwrap.wrap(" ".join(text.split()) or "(empty)", column)
        return lines[:3] if len(lines) <= 3 else [*lines[:2], textwrap.shorten(lines[2], column - 2) + " …"]

    left, right = cell(row.pd_text), cell(row.colocated_text)
    out = [f"[{index}/{len(PROMPTS)}] {row.name} prompt ({prompt_tokens} tokens)  "
           f"{'same answer' if row.same else 'ANSWERS DIFFER'}",
           f"  {'P/D (through the proxy)':<{column}} | colocated"]
    for i in range(max(len(left), len(right))):
        a = left[i] if i < len(left) else ""
        b = right[i] if i < len(right) else ""
        out.append(f"  {a:<{column}} | {b}")
    out.append(f"  {row.line}\n")
    return "\n".join(out)
