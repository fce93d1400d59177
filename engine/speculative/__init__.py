"""Speculative decoding (seed section 6): methods by name, imported lazily."""

from __future__ import annotations

import importlib

_METHODS = {
    "mtp": "engine.speculative.mtp_worker:build_mtp_worker",
}


def speculative_methods() -> list[str]:
    return sorted(_METHODS)


def build_speculative_worker(engine):
    """The SpeculativeWorker for engine.config.speculative_method."""
    method = engine.config.speculative_method
    if method not in _METHODS:
        raise ValueError(f"unknown speculative_method {method!r}; available: "
                         f"{', '.join(speculative_methods())}")
    module, fn = _METHODS[method].split(":")
    return getattr(importlib.import_module(module), fn)(engine)
