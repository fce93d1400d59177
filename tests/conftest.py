"""Shared fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Under the (git-ignored) venv: reused across runs, never committed, gone with `make clean`.
DEFAULT_MODEL_CACHE = REPO / ".venv" / "pdserve-cache"


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The prepared SmolLM2-135M-Instruct HF folder (converted from the GGUF on first use)."""
    from launch.default_model import prepare_default_model

    return prepare_default_model(DEFAULT_MODEL_CACHE, progress=False)
