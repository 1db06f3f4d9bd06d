"""CLI commands that need neither torch nor NIXL do not import them (a fresh interpreter each)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvlink.cli.main import BENCHES, COMMANDS
from kvlink.procs.launcher import free_port

pytestmark = pytest.mark.timeout(120)

HEAVY = ("torch", "nixl", "nixl_cu12", "nixl_cu13")

# Runs each command through `main` in one interpreter, uvicorn's serving stubbed (the proxy
# would serve forever; it still binds its port), and prints, after each, its exit code, the heavy packages
# loaded so far and the kvlink subpackages loaded so far.
WRAPPER = """
import json, sys
import uvicorn
def _started(self, sockets=None):
    self.started = True
uvicorn.Server.run = _started
from kvlink.cli.main import main
heavy, seen = set(json.loads(sys.argv[1])), {}
for argv in json.loads(sys.argv[2]):
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    except Exception as exc:
        code = repr(exc)
    loaded = sorted({name.split(".")[0] for name in sys.modules} & heavy)
    ours = sorted({name.split(".")[1] for name in sys.modules if name.startswith("kvlink.")})
    seen[" ".join(argv)] = [code, loaded, ours]
print(json.dumps(seen))
"""

LIGHT_RUNS = [
    ["plan", "--preset", "hybrid-mamba2", "--p-tp", "2", "--d-tp", "1", "--tokens", "40", "--json"],
    ["plan", "--preset", "deepseek-mla", "--p-tp", "4", "--d-tp", "1", "--tokens", "20"],
    ["bench", "plan", "--tokens", "1024", "--repeat", "1"],
    ["proxy", "--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9", "--port", str(free_port())],
]
HELP_RUNS = [["--help"], ["bench", "--help"], *([name, "--help"] for name in COMMANDS),
             *(["bench", name, "--help"] for name in BENCHES)]


def test_light_commands_and_every_help_load_neither_torch_nor_nixl() -> None:
    runs = LIGHT_RUNS + HELP_RUNS
    out = subprocess.run([sys.executable, "-c", WRAPPER, json.dumps(HEAVY), json.dumps(runs)],
                         capture_output=True, text=True, timeout=100, check=True).stdout
    seen = json.loads(out.splitlines()[-1])
    assert list(seen) == [" ".join(argv) for argv in runs]
    # the first command that loads a heavy package is the one named with it
    assert {cmd: result[:2] for cmd, result in seen.items() if result[:2] != [0, []]} == {}
    # `kvlink plan` (run first) loads no other command's modules: no engine, serving or transfer code
    assert seen[" ".join(LIGHT_RUNS[0])][2] == ["cli", "layout", "plan"]
