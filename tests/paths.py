"""Where the checkout is, for tests at any depth under tests/ (a test module's own `__file__`
says nothing about the repository root once it sits in a sub-folder)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
