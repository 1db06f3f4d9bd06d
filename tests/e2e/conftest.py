"""End-to-end tests: their helpers (`e2e_helpers`) are importable from this directory."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
