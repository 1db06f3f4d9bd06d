"""Shorten how long vLLM's shared-memory queues busy-poll after each message.

vLLM 0.32's `MessageQueue` readers (a worker waiting for its next step, the engine core
waiting for a worker's output) spin on `sched_yield` for one second after every message
before they fall back to waiting on a socket. An engine that kvlink keeps stepping (P holding
a lease, D waiting for a load) never leaves that spin, and its worker holds its pinned core:
a peer worker pinned to the same core (three TP workers on two cores) then starved until
the lease ran out.

`shorten_queue_spin(s)` sets that window to `s` seconds for every reader queue of this
process: back-to-back steps still find their message without sleeping, and a reader idle
for longer waits on the queue's notification socket (a wake-up of tens of microseconds).
"""

from __future__ import annotations

import gc
import logging
import warnings

log = logging.getLogger("kvlink.integrations.vllm")


def shorten_queue_spin(busy_loop_s: float) -> int:
    """Set the busy-poll window of this process's vLLM queue readers; returns how many changed."""
    try:
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
    except ImportError:  # another vLLM layout: leave it alone
        return 0
    changed = 0
    with warnings.catch_warnings():  # isinstance on deprecated torch proxies warns
        warnings.simplefilter("ignore")
        queues = [obj for obj in gc.get_objects() if _is_queue(obj, MessageQueue)]
    for obj in queues:
        condition = getattr(obj, "_spin_condition", None)
        if condition is not None and getattr(condition, "is_reader", False) and \
                getattr(condition, "busy_loop_s", 0) > busy_loop_s:
            condition.busy_loop_s = busy_loop_s
            changed += 1
    if changed:
        log.info("kvlink: %d vLLM queue reader(s) in this process now busy-poll %.1f ms after a "
                 "message (vLLM's default: 1 s)", changed, busy_loop_s * 1e3)
    return changed


def _is_queue(obj: object, kind: type) -> bool:
    try:
        return isinstance(obj, kind)
    except Exception:  # a lazy proxy object may raise on isinstance
        return False
