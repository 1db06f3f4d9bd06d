"""Push and layerwise loads whose request ended before P finished writing (the client left).

D cannot give such a load's blocks back at once: P may be writing into them, layer by layer,
for the rest of its forward. So D asks every source rank that has not pushed yet to stop
(`Cancel`); a rank drops its job, lets the WRITEs it already posted land, and answers
`Cancelled` (a rank whose last WRITE, with `pushed`, is in flight answers with that). Once
every rank has answered, the load fails as cancelled and its blocks return at once. A rank
that never answers leaves the load to its deadline, which quarantines the blocks as for any
stalled push. P counts the cancel as that D's `done`, so it frees its own blocks too.
"""

from __future__ import annotations

import logging

from kvlink.connector.notifs import Cancel, encode
from kvlink.connector.worker_parts import WorkerParts
from kvlink.transfer.xfer import TransferFailed

log = logging.getLogger("kvlink.connector.cancels")


def cancel_load(w: WorkerParts, request_id: str, d_rank: int) -> bool:
    """D: ask the sources of `request_id`'s push load to stop. False: no such load here."""
    load = w.book.get(request_id)
    if load is None:
        return False
    if load.failed or load.cancelled or len(load.pushes_seen) >= load.pushes_expected:
        return True  # over, already asked, or every source pushed (its check ends it)
    engine = w.engines.get(str(load.entry["remote_engine_id"]))
    if engine is None or engine.plan is None:
        return True  # never asked anyone: the deadline ends it
    load.cancelled = True
    w.stats.count("cancelled_loads_total")
    msg = encode(Cancel(str(load.entry["remote_request_id"]), request_id, w.config.engine_id, d_rank), w.secret)
    asked = 0
    for _, name in engine.notify_agents(engine.plan.mapping.source_ranks):
        if name in load.pushes_seen:
            continue
        try:
            w.send_or_raise(name, msg, engine)
            asked += 1
        except TransferFailed as exc:  # that rank's silence leaves the load to its deadline
            w.stats.count("failed_notifications_total")
            log.warning("request %s: cancel not sent to %s: %s", request_id, name, exc.reason)
    log.info("request %s ended while P was to write it: asked %d source rank(s) to stop", request_id, asked)
    return True


def on_cancelled(w: WorkerParts, request_id: str, sender: str) -> None:
    """D: one source rank has stopped writing into `request_id`'s blocks."""
    load = w.book.get(request_id)
    if load is None or load.failed or not load.cancelled:
        log.info("cancel answer for %s from %s ignored (no such cancelled load)", request_id, sender)
        return
    load.cancel_acks.add(sender)
    answered = load.pushes_seen | load.cancel_acks
    if len(answered) >= load.pushes_expected:
        load.pushes_seen = answered  # nothing of any source is in flight into these blocks
        w.fail_request(request_id, load.blocks, "cancelled: the request ended before P finished "
                       "writing it; every source rank has stopped")
