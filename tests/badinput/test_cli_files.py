"""Commands refuse paths they could never write, files that are not what they read, and
sizes they cannot run, at once and in one line (exit 2): not with a traceback at the end of
a long run."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvlink.cli.argtypes import output_dir, output_file

KVLINK = [sys.executable, "-m", "kvlink.cli.main"]


def _run(*argv: str, limit_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "UCX_NET_DEVICES": "lo"}
    return subprocess.run([*KVLINK, *argv], env=env, capture_output=True, text=True, timeout=limit_s)


def _refused(proc: subprocess.CompletedProcess[str], words: str) -> None:
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert words in proc.stderr and "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-2000:]


def test_output_paths_are_checked_and_left_as_found(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for bad in (str(tmp_path), str(blocker / "x.json"), ""):
        with pytest.raises(argparse.ArgumentTypeError):
            output_file(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="cannot write into"):
        output_dir(str(blocker / "logs"))
    new = output_file(str(tmp_path / "new" / "deeper" / "r.json"))
    assert new.parent.is_dir() and not new.exists()  # the directory is made, the file is not left behind
    kept = tmp_path / "kept.json"
    kept.write_text("old")
    assert output_file(str(kept)) == kept and kept.read_text() == "old"
    logs = output_dir(str(tmp_path / "logs" / "run1"))
    assert logs.is_dir() and list(logs.iterdir()) == []
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "nowhere" / "x.json")
    with pytest.raises(argparse.ArgumentTypeError, match="link to nowhere"):
        output_file(str(dangling))
    assert dangling.is_symlink() and not (tmp_path / "nowhere").exists()  # the link is left as it was
    with pytest.raises(argparse.ArgumentTypeError):
        output_dir(str(blocker / "a" / "b"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "dangling.json", "kept.json", "logs", "new"]


def test_bench_outputs_refused_before_the_run(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    _refused(_run("bench", "digest", "--passes", "1", "--json", str(blocker / "x.json")), "cannot write")
    _refused(_run("bench", "plan", "--json", str(tmp_path)), "expected a file path")
    _refused(_run("vllm-models", "--out", str(blocker / "models")), "cannot write into")


@pytest.mark.parametrize("content, words", [
    (None, "cannot read --from-json"), ("{not json", "cannot read --from-json"),
    ("[1]", "is not a saved"), ("{}", "is not a saved"), ('{"cases": [{"x": 1}]}', "is not a complete"),
])
def test_bench_vllm_from_json_refuses_what_is_not_a_report(tmp_path: Path, content: str | None, words: str) -> None:
    path = tmp_path / "report.json"
    if content is not None:
        path.write_text(content)
    _refused(_run("bench", "vllm", "--from-json", str(path), "--out-dir", str(tmp_path / "out")), words)


def test_bench_transfer_refuses_sizes_it_cannot_run() -> None:
    _refused(_run("bench", "transfer", "--p-tp", "3", "--tokens", "512"), "TP 3 cannot shard")
    _refused(_run("bench", "transfer", "--tokens", "16777216"), "over --max-gib 2")


def test_bench_transfer_runs_a_request_of_one_partial_block(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    proc = _run("bench", "transfer", "--preset", "smollm2-135m", "--tokens", "15", "--layers", "1",
                "--repeats", "1", "--min-seconds", "0", "--json", str(out), limit_s=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert out.stat().st_size > 0


def test_demo_refuses_a_tp_the_model_cannot_split() -> None:
    _refused(_run("demo", "--p-tp", "2"), "--p-tp: TP 2 cannot shard kv (3 units)")
