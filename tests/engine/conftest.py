"""Fixtures shared by the engine's tests."""

from __future__ import annotations

import pytest

from engine.layers import kernel_choice


@pytest.fixture
def choices(tmp_path, monkeypatch):
    """A kernel-choice cache of the test's own (the machine's is neither read nor written)."""
    cache = kernel_choice.ChoiceCache(tmp_path / "choices.json")
    monkeypatch.setattr(kernel_choice, "CHOICES", cache)
    return cache
