"""`kvlink bench load --router both` on 2P2D: a few requests through vllm-router and through
kvlink's proxy on the same instances, some cancelled; no errors beyond the cancels, nothing
held afterwards, and a client's disconnect reaches D through either router."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvlink.cli.main import main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

REQUESTS = 10


def test_load_through_both_routers_on_one_2p2d(tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    code = main(["bench", "load", "--model", "tiny-hybrid", "--router", "both", "--prefills", "2",
                 "--decodes", "2", "--requests", str(REQUESTS), "--concurrency", "4", "--cancel-fraction", "0.3",
                 "--json", str(out), "--log-dir", str(tmp_path / "logs")])
    summary = json.loads(out.read_text())
    assert code == 0 and summary["passed"], summary
    assert list(summary["routers"]) == ["vllm-router", "kvlink"]
    names = {"prefill", "prefill1", "decode", "decode1"}
    for router, result in summary["routers"].items():
        assert result["errors"] == 0, (router, result)
        assert result["ok"] + result["cancelled"] + result["cancelled_after_finishing"] == REQUESTS
        assert result["cancelled"] + result["cancelled_after_finishing"] == 3
        assert result["leaks"] == {} and result["leaks_after_probe"] == {}, (router, result)
        assert set(result["requests_per_instance"]) == names
        assert sum(result["requests_per_instance"][n] for n in ("decode", "decode1")) >= result["ok"]
        assert result["disconnect_reaches_decode"], (router, result["disconnect_probe"])
