"""Where the checkout is, for tests at any depth under tests/ (a test module's own `__file__`
says nothing about the repository root once it sits in a sub-folder)."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
# Where tests leave what a person may want to look at (screenshots, recorded requests).
ARTIFACTS = Path(os.environ.get("DSS_TEST_ARTIFACTS") or REPO / "tests" / "artifacts")
