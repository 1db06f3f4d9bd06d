"""A worker's NIXL notification inbox: decode each message, check it, dispatch it.

Anything that is not one of our messages, or not signed with the shared secret when
one is configured, is logged, counted and dropped; it never changes another request.
"""

from __future__ import annotations

import logging

from kvlink.connector.cancels import on_cancelled
from kvlink.connector.lease import LeaseTable
from kvlink.connector.notifs import (
    BadNotification,
    Cancel,
    Cancelled,
    Done,
    Heartbeat,
    Pushed,
    PushRequest,
    UnauthenticatedNotification,
    decode,
)
from kvlink.connector.push import PushWriter
from kvlink.connector.stats import ConnectorStats
from kvlink.transfer.agent import NixlAgent

log = logging.getLogger("kvlink.connector")


def drain_notifications(agent: NixlAgent, secret: bytes | None, stats: ConnectorStats,
                        leases: LeaseTable, push: PushWriter, now: float) -> None:
    """Dispatch what `agent` received: frees to `leases`, push traffic to `push`. Also drives
    NIXL progress when the agent runs without a progress thread."""
    for sender, messages in agent.get_notifs().items():
        for raw in messages:
            try:
                msg = decode(raw, secret)
            except UnauthenticatedNotification as exc:
                stats.count("unauthenticated_notifications_total")
                log.warning("dropping notification from %s: %s", sender, exc)
                continue
            except BadNotification as exc:
                stats.count("bad_notifications_total")
                log.warning("dropping notification from %s: %s", sender, exc)
                continue
            # A layerwise D names P's request by the key the proxy gave both (an engine like
            # vLLM renames its requests): `resolve` maps it to P's own id.
            if isinstance(msg, Done):
                leases.notify(push.resolve(msg.request_id), msg.expected, now)
            elif isinstance(msg, Heartbeat):
                leases.heartbeat([push.resolve(rid) for rid in msg.request_ids], now)
            elif isinstance(msg, PushRequest):
                push.on_push_request(msg, now)
            elif isinstance(msg, Pushed):
                push.on_pushed(msg.request_id, sender, msg.remote_block_ids)
            elif isinstance(msg, Cancel):
                push.on_cancel(msg)
            elif isinstance(msg, Cancelled):
                on_cancelled(push.worker, msg.request_id, sender)
