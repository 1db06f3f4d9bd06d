"""Params as only P could make them: tests that play P (or a router that mixed things up)
change `kv_transfer_params` and sign them again with the deployment's secret, so the
change reaches D's load path instead of being refused as a forgery."""

from __future__ import annotations

import time
from typing import Any

from kvlink.connector.params import sign


def resigned(params: dict[str, Any], secret: str, **changes: Any) -> dict[str, Any]:
    """`params` with `changes`, an expiry a minute ahead if they had none, signed with `secret`."""
    changed = {"kv_expires_at_ms": int((time.time() + 60) * 1000), **params, **changes}
    return {**changed, "kv_signature": sign(changed, secret.encode())}
