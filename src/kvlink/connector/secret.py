"""The shared secret of a P/D deployment: where it comes from, and the rule that P and D need one.

P signs the `kv_transfer_params` it hands out with it and D checks them before reading
anything; handshakes and NIXL notifications are authenticated with it too. Without it a
client that reaches D could point D at another request's blocks on P (NIXL has no
per-request authorization), so a connector refuses to run without a secret unless the
operator opted out explicitly (`insecure_unsigned_params`).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from pathlib import Path

from kvlink.transfer.framing import SECRET_ENV, resolve_secret

MIN_SECRET_BYTES = 16
HOW_TO_SET = (
    f"set the same secret on every prefill and decode instance: {SECRET_ENV}=<random string> in "
    "the environment, or `--secret-file PATH` (the file's contents) for `kvlink serve`, or "
    "`secret_file` / `secret` in vLLM's kv_connector_extra_config "
    f"(make one with: python -c 'import secrets; print(secrets.token_hex(32))'); at least "
    f"{MIN_SECRET_BYTES} bytes"
)
INSECURE_WARNING = (
    "kv_transfer_params are NOT signed (--insecure-unsigned-params): any client that reaches "
    "a decode instance can make it read another request's KV blocks from a prefill instance. "
    f"Use only on a network where nothing untrusted reaches P or D; set {SECRET_ENV} or "
    "--secret-file instead"
)


class MissingSecret(ValueError):
    """A prefill or decode connector was configured without a shared secret and without the opt-out."""


def new_secret() -> str:
    """A fresh random secret for one deployment (demo, benches, tests): 64 hex characters."""
    return secrets.token_hex(32)


def too_short(value: bytes, source: str) -> str | None:
    """Why a secret from `source` is refused for its length, or None."""
    if len(value.strip()) >= MIN_SECRET_BYTES:
        return None
    return (f"{source} holds a secret of {len(value.strip())} bytes; it must be at least "
            f"{MIN_SECRET_BYTES} bytes (random); {HOW_TO_SET}")


def load_secret(secret_file: str | Path | None = None,
                environ: Mapping[str, str] = os.environ) -> bytes | None:
    """The file's contents (surrounding whitespace stripped) if a file is given, else
    `$KVLINK_SECRET`; None if neither is set. Too short a secret is refused."""
    if secret_file is not None:
        try:
            value = Path(secret_file).read_bytes().strip()
        except OSError as error:
            raise ValueError(f"--secret-file {secret_file}: cannot read it ({error.strerror})") from None
        source = f"--secret-file {secret_file}"
    else:
        value = environ.get(SECRET_ENV, "").strip().encode()
        source = SECRET_ENV
    if not value:
        if secret_file is not None:
            raise ValueError(f"{source} is empty; {HOW_TO_SET}")
        return None
    try:
        value.decode()
    except UnicodeDecodeError:  # it travels to TP followers in the environment
        raise ValueError(f"{source} is not UTF-8 text; write the secret as text, e.g. hex "
                         "(python -c 'import secrets; print(secrets.token_hex(32))')") from None
    if (why := too_short(value, source)) is not None:
        raise ValueError(why)
    return value


def require_secret(secret: bytes | None, insecure_unsigned_params: bool, engine_id: str) -> bytes | None:
    """The secret to sign and check params with (`secret`, else `$KVLINK_SECRET`); None only
    with the explicit opt-out. Raises MissingSecret saying how to set one."""
    resolved = resolve_secret(secret)
    if resolved is None and not insecure_unsigned_params:
        raise MissingSecret(
            f"connector {engine_id!r} has no shared secret, so it could neither sign nor check "
            f"kv_transfer_params; {HOW_TO_SET}. To run without one on a fully trusted network, "
            "pass --insecure-unsigned-params to `kvlink serve`, or set insecure_unsigned_params: true "
            "in vLLM's kv_connector_extra_config (ConnectorConfig.insecure_unsigned_params=True)")
    if resolved is not None and (why := too_short(resolved, f"connector {engine_id!r}'s shared secret")):
        raise MissingSecret(why)
    return resolved
