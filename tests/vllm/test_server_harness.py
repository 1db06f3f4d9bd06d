"""The vLLM test harness's own logic (no vLLM process): servers started alongside a reference
are taken over by a later start of an equal spec, and stopped at the end of the module when
nobody asked for them."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import pytest

from kvlink.integrations.vllm.launch import VllmServerSpec

if TYPE_CHECKING:
    from tests.vllm.conftest import VllmServers


@pytest.fixture
def harness(vllm_servers: VllmServers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A fresh launcher of the session's kind whose processes are stand-ins."""
    module = sys.modules[type(vllm_servers).__module__]
    events: list[str] = []

    def start_server(spec: VllmServerSpec, _log_dir: Path) -> Any:
        events.append(f"start {spec.name} {' '.join(spec.args)}".strip())
        return SimpleNamespace(name=spec.name, proc=SimpleNamespace(poll=lambda: None))

    monkeypatch.setattr(module, "start_server", start_server)
    monkeypatch.setattr(module, "wait_ready", lambda services, _t: events.append(
        "wait " + " ".join(s.name for s in services)))
    monkeypatch.setattr(module, "stop_servers", lambda services: events.append(
        "stop " + " ".join(s.name for s in services)))
    return type(vllm_servers)(tmp_path), events


def spec(name: str, connector: bool = True) -> VllmServerSpec:
    return VllmServerSpec(model=Path("m"), port=1, name=name,
                          kv_transfer_config={"kv_connector": "KvlinkConnector"} if connector else None)


def test_alongside_servers_are_taken_over_or_stopped(harness: Any) -> None:
    servers, events = harness
    p, d = spec("p"), spec("d")
    (ref,) = servers.start(spec("ref", connector=False), alongside=iter([p, d]))
    assert events == ["start ref --distributed-executor-backend uni", "start p", "start d", "wait ref"]
    servers.stop(ref)
    events.clear()
    got = servers.start(spec("d"), spec("x"), alongside=[spec("y")])  # d is taken over, p waits
    assert [s.name for s in got] == ["d", "x"]
    assert events == ["start x", "start y", "wait d x"]
    events.clear()
    (y,) = servers.start(spec("y"))  # started alongside the last start: taken over
    assert y.name == "y" and events == ["wait y"]
    events.clear()
    servers.drop_unclaimed()  # the end of the module: p was never asked for
    assert events == ["stop p"]
    servers.drop_unclaimed()
    assert events == ["stop p"]
