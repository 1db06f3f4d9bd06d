"""`kvlink serve --role prefill|decode` and the shared secret, as real processes.

Without a secret (`$KVLINK_SECRET` or `--secret-file`) P and D refuse to start and say how
to set one or opt out; a too-short secret is refused naming its size. `--secret-file` is
what P signs its params with. The opt-out `--insecure-unsigned-params` starts, but says so
loudly: a WARNING in the log, on /health and as a gauge in /metrics.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvlink.connector.params import parse_remote_prefill, sign
from kvlink.connector.secret import MIN_SECRET_BYTES, SECRET_ENV, new_secret
from kvlink.procs.launcher import Service, free_port, start_service, stop_all, wait_healthy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
COMMON = ["--model", "tiny-hybrid", "--num-blocks", "16", "--threads", "1"]


def _serve(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvlink.cli.main", "serve", *args, *COMMON,
                           "--port", str(free_port()), "--kv-port", "0"],
                          capture_output=True, text=True, timeout=120, env=env)


@pytest.fixture
def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != SECRET_ENV}


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_p_and_d_refuse_to_start_without_a_secret(role: str, clean_env: dict[str, str]) -> None:
    done = _serve("--role", role, env=clean_env)
    assert done.returncode == 2, done.stdout + done.stderr
    for needle in (SECRET_ENV, "--secret-file", "--insecure-unsigned-params"):
        assert needle in done.stderr, done.stdout + done.stderr


def test_a_short_secret_is_refused_naming_its_size(tmp_path: Path, clean_env: dict[str, str]) -> None:
    short = tmp_path / "short"
    short.write_text("tooshort")
    done = _serve("--role", "decode", "--secret-file", str(short), env=clean_env)
    assert done.returncode == 2
    assert f"holds a secret of 8 bytes; it must be at least {MIN_SECRET_BYTES} bytes" in done.stderr, done.stderr
    done = _serve("--role", "prefill", "--insecure-unsigned-params", env={**clean_env, SECRET_ENV: new_secret()})
    assert done.returncode == 2 and "drop one of them" in done.stderr, done.stderr


@pytest.fixture
def secret_file_p_and_insecure_d(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Service, Service, bytes]]:
    monkeypatch.delenv(SECRET_ENV, raising=False)  # start_service passes our environment on
    secret = new_secret()
    path = tmp_path / "kvlink.secret"
    path.write_text(secret + "\n")
    p_port, d_port = free_port(), free_port()
    services = [
        start_service("p-secret-file", ["serve", "--role", "prefill", "--port", str(p_port), "--kv-port", "0",
                                        "--secret-file", str(path), *COMMON], p_port, tmp_path),
        start_service("d-insecure", ["serve", "--role", "decode", "--port", str(d_port), "--kv-port", "0",
                                     "--insecure-unsigned-params", *COMMON], d_port, tmp_path),
    ]
    try:
        wait_healthy(services, 120, progress=lambda line: None)
        yield services[0], services[1], secret.encode()
    finally:
        stop_all(services)


def test_secret_file_signs_and_the_opt_out_warns(secret_file_p_and_insecure_d: tuple[Service, Service, bytes]) -> None:
    p, d, secret = secret_file_p_and_insecure_d
    r = httpx.post(p.url + "/v1/completions", timeout=60, json={
        "prompt": "hello", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert params["kv_signature"] == sign(params, secret)  # signed with the file's secret
    parse_remote_prefill(params)
    assert "warnings" not in httpx.get(p.url + "/health", timeout=5).json()
    health = httpx.get(d.url + "/health", timeout=5).json()
    assert health["status"] == "ok" and "NOT signed" in health["warnings"][0], health
    assert "kvlink_server_insecure_unsigned_params 1" in httpx.get(d.url + "/metrics", timeout=5).text
    assert "WARNING: kv_transfer_params are NOT signed" in d.log_path.read_text()
    assert "NOT signed" not in p.log_path.read_text()
