"""The small checkpoint that ships with the project, served when no model is named."""

from __future__ import annotations

from pathlib import Path

SHIPPED_MODEL = Path(__file__).resolve().parent / "checkpoints" / "flashnext-small"
