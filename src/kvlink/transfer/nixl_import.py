"""Import exactly one installed NIXL Python package and expose what kvlink uses from it.

Preference order is ``nixl_cu12``, ``nixl_cu13``, then the ``nixl`` meta-package.
Two of them must never share a process: their pybind modules register the same
types and the second import fails. If one is already imported (by the host
engine, say), that one is reused.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType
from typing import Any

CANDIDATES: tuple[str, ...] = ("nixl_cu12", "nixl_cu13", "nixl")


class NixlUnavailable(ImportError):
    """No usable NIXL package could be imported."""


def _choose_package() -> str:
    for name in CANDIDATES:
        if name in sys.modules:
            return name
    for name in CANDIDATES:
        if importlib.util.find_spec(name) is not None:
            return name
    raise NixlUnavailable(
        f"none of the NIXL packages {', '.join(CANDIDATES)} is installed; "
        "install one, e.g. `pip install nixl-cu12==1.5.1` after a CPU torch "
        "(see docs/transfer.md)"
    )


def _load(package: str) -> tuple[ModuleType, ModuleType]:
    """Return (api module, bindings module) of the chosen package."""
    try:
        importlib.import_module(package)
    except ImportError as exc:
        raise NixlUnavailable(f"importing NIXL package {package!r} failed: {exc}") from exc
    if package == "nixl":
        # The meta-package loads one concrete backend package; use that one's modules.
        concrete = next((n for n in CANDIDATES[:2] if n in sys.modules), None)
        if concrete is None:
            raise NixlUnavailable("the 'nixl' meta-package loaded no nixl_cu12/nixl_cu13 backend")
        package = concrete
    api = importlib.import_module(f"{package}._api")
    bindings = importlib.import_module(f"{package}._bindings")
    return api, bindings


PACKAGE_NAME: str = _choose_package()
api: Any
bindings: Any
api, bindings = _load(PACKAGE_NAME)

nixl_agent: Any = api.nixl_agent
nixl_agent_config: Any = api.nixl_agent_config

# Every error class the bindings define; NIXL reports failures only by raising these.
NIXL_ERRORS: tuple[type[BaseException], ...] = tuple(
    obj
    for attr, obj in vars(bindings).items()
    if attr.startswith("nixl") and attr.endswith("Error") and isinstance(obj, type)
)
NixlNotAllowedError: type[BaseException] = bindings.nixlNotAllowedError
NixlNoTelemetryError: type[BaseException] = bindings.nixlNoTelemetryError
