"""A worker's NIXL notification inbox: decode each message, check it, dispatch it.

Anything that is not one of our messages, or not signed with the shared secret when
one is configured, is logged, counted and dropped; it never changes another request.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvlink.connector.notifs import (
    BadNotification,
    Done,
    Heartbeat,
    Pushed,
    PushRequest,
    UnauthenticatedNotification,
    decode,
)

if TYPE_CHECKING:
    from kvlink.connector.worker import NixlWorker

log = logging.getLogger("kvlink.connector")


def drain_notifications(worker: NixlWorker, now: float) -> None:
    """Also drives NIXL progress when the agent runs without a progress thread."""
    assert worker.agent is not None and worker.push is not None
    for sender, messages in worker.agent.get_notifs().items():
        for raw in messages:
            try:
                msg = decode(raw, worker.secret)
            except UnauthenticatedNotification as exc:
                worker.stats.count("unauthenticated_notifications_total")
                log.warning("dropping notification from %s: %s", sender, exc)
                continue
            except BadNotification as exc:
                worker.stats.count("bad_notifications_total")
                log.warning("dropping notification from %s: %s", sender, exc)
                continue
            if isinstance(msg, Done):
                worker.leases.notify(msg.request_id, msg.expected, now)
            elif isinstance(msg, Heartbeat):
                worker.leases.heartbeat(list(msg.request_ids), now)
            elif isinstance(msg, PushRequest):
                worker.push.on_push_request(msg, now)
            elif isinstance(msg, Pushed):
                worker.push.on_pushed(msg.request_id, sender)
