"""A scripted in-test engine and a character tokenizer, to test serving logic in isolation.

The fake follows the engine contract (add_request / abort / step / has_unfinished /
stats, one thread) and generates "abcd..." so outputs are predictable. Prompts
steer it: "hang" never produces a token, "fail" finishes with an error ("fail:KIND"
with the engine's error_kind KIND, "late-fail" after two tokens), "crash" makes
step() raise. A request with `kv_transfer_params` reports 4096 KV bytes loaded, and with
`do_remote_prefill` 1024 of them checked (as D does under verify_kv). The real engine is
exercised by test_real_server.py.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn


@dataclass
class FakeSampling:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    min_tokens: int = 0


@dataclass
class FakeOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    kv_bytes: int | None = None
    kv_verified_bytes: int | None = None
    error_kind: str | None = None


@dataclass
class _Running:
    prompt: list[int]
    sampling: FakeSampling
    params: dict[str, Any] | None
    produced: int = 0


@dataclass
class FakeEngine:
    running: dict[str, _Running] = field(default_factory=dict)
    aborted: list[str] = field(default_factory=list)
    pending: list[FakeOutput] = field(default_factory=list)
    seen: dict[str, tuple[list[int], Any, dict[str, Any] | None]] = field(default_factory=dict)
    threads: set[int] = field(default_factory=set)
    # When set, add_request announces itself in `adding` and waits for `add_gate` (5 s at most).
    add_gate: threading.Event | None = None
    adding: threading.Event = field(default_factory=threading.Event)
    # As LLMEngine without a connector: P's or D's kv_transfer_params are refused.
    colocated: bool = False

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: Any,
                    kv_transfer_params: dict[str, Any] | None = None) -> None:
        self.threads.add(threading.get_ident())
        if self.add_gate is not None:
            self.adding.set()
            self.add_gate.wait(5)
        if self.colocated and kv_transfer_params:
            from kvlink.connector.params import InvalidTransferParams
            raise InvalidTransferParams("kv_transfer_params ask for a KV connector; this engine serves colocated")
        if kv_transfer_params is not None and "do_remote_decode" not in kv_transfer_params \
                and "do_remote_prefill" not in kv_transfer_params:
            raise ValueError(f"kv_transfer_params has no known mode: {sorted(kv_transfer_params)}")
        self.seen[request_id] = (list(prompt_token_ids), sampling, kv_transfer_params)
        self.running[request_id] = _Running(list(prompt_token_ids), sampling, kv_transfer_params)

    def abort(self, request_id: str) -> None:
        self.threads.add(threading.get_ident())
        self.aborted.append(request_id)
        if self.running.pop(request_id, None) is not None:
            self.pending.append(FakeOutput(request_id, [], True, "abort"))  # as the real engine does

    def has_unfinished(self) -> bool:
        return bool(self.running or self.pending)

    def step(self) -> list[FakeOutput]:
        self.threads.add(threading.get_ident())
        outputs, self.pending = self.pending, []
        for request_id, req in list(self.running.items()):
            text = "".join(chr(t) for t in req.prompt)
            if "crash" in text:
                raise RuntimeError("simulated engine crash")
            if "hang" in text:
                continue
            if "slow" in text:
                time.sleep(0.5 if "very-slow" in text else 0.05)
            if "fail" in text and ("late-fail" not in text or req.produced >= 2):
                del self.running[request_id]
                kind = text.split("fail:", 1)[1].split()[0] if "fail:" in text else None
                outputs.append(FakeOutput(request_id, [], True, "error", "simulated KV load failure",
                                          error_kind=kind))
                continue
            token = ord("a") + req.produced % 26
            req.produced += 1
            out = FakeOutput(request_id, [token], kv_bytes=4096 if req.params else None)
            if req.params and req.params.get("do_remote_prefill") and req.produced == 1:
                out.kv_verified_bytes = 1024  # D checked a sample of what it loaded
            remote_decode = bool(req.params and req.params.get("do_remote_decode"))
            if req.produced >= req.sampling.max_tokens or remote_decode:
                out.finished, out.finish_reason = True, "length"
                if remote_decode:
                    out.kv_transfer_params = {"do_remote_prefill": True, "remote_engine_id": "fake-p",
                                              "remote_request_id": request_id, "remote_block_ids": [1, 2]}
                del self.running[request_id]
            outputs.append(out)
        return outputs

    def stats(self) -> dict[str, Any]:
        return {"running": len(self.running), "waiting": 0, "free_blocks": {"0": 100}}


class FakeIncrementalDecoder:
    def push(self, token_id: int) -> str:
        return chr(token_id)

    def flush(self) -> str:
        return ""


class FakeTokenizer:
    vocab_size = 256
    eos_token_ids = frozenset({0})

    def encode(self, text: str) -> list[int]:
        return [min(ord(c), 255) for c in text]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids)

    def incremental_decoder(self, skip_special_tokens: bool = True) -> FakeIncrementalDecoder:
        return FakeIncrementalDecoder()

    def apply_chat_template(self, messages: Sequence[dict[str, str]],
                            add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
        self.template_kwargs = template_kwargs
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + "<assistant>" if add_generation_prompt else text


@contextmanager
def serve_in_thread(app: Any) -> Iterator[str]:
    """Run an ASGI app with uvicorn on a free 127.0.0.1 port; yield its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(5)
        sock.close()

