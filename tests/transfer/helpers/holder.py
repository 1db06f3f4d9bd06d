"""Test peer playing P: registers a patterned buffer, serves its payload, reports notifications.

Prints ``READY <port>`` once serving. For each notification it prints
``NOTIF <sender> <message>``; the message ``digest`` also prints
``DIGEST <blake2b of the whole buffer>`` and ``exit`` ends the process.
It exits on its own after ``--max-seconds`` so it can never be orphaned.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time

import msgspec
import numpy as np

from kvlink.transfer.agent import NixlAgent
from kvlink.transfer.agent_config import AgentConfig
from kvlink.transfer.side_channel import HandshakeServer
from kvlink.transfer.wire import PROTOCOL_VERSION, HandshakePayload


def pattern(seed: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", required=True)
    parser.add_argument("--engine-id", required=True)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--block-bytes", type=int, default=16384)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-seconds", type=float, default=30.0)
    args = parser.parse_args()

    buffer = pattern(args.seed, args.blocks * args.block_bytes)
    agent = NixlAgent(args.name, AgentConfig())
    agent.register_regions([(buffer.ctypes.data, buffer.nbytes)])
    geometry = msgspec.msgpack.encode(
        {"base": buffer.ctypes.data, "blocks": args.blocks, "block_bytes": args.block_bytes}
    )
    server = HandshakeServer(args.engine_id)
    server.set_payload(
        0,
        HandshakePayload(
            version=PROTOCOL_VERSION,
            engine_id=args.engine_id,
            tp_rank=0,
            tp_size=1,
            compat_hash="test",
            agent_name=agent.name,
            agent_metadata=agent.metadata(),
            geometry=geometry,
            sent_time=0.0,
        ),
    )
    print(f"READY {server.port}", flush=True)
    end = time.monotonic() + args.max_seconds
    while time.monotonic() < end:
        for sender, messages in agent.get_notifs().items():
            for message in messages:
                print(f"NOTIF {sender} {message.decode(errors='replace')}", flush=True)
                if message == b"digest":
                    print(f"DIGEST {hashlib.blake2b(buffer.tobytes()).hexdigest()}", flush=True)
                elif message == b"exit":
                    end = 0.0
        time.sleep(0.0005)
    server.close()
    agent.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
