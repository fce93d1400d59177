"""Speculative decoding (docs/ARCHITECTURE.md, 'The execution trunk', step 8): methods by name,
imported lazily."""

from __future__ import annotations

import importlib

_METHODS = {
    "mtp": "engine.speculative.mtp_worker:build_mtp_worker",
}


def speculative_methods() -> list[str]:
    return sorted(_METHODS)


def prepare_target(config, model) -> None:
    """What the target model must return for the draft (before its executor is built:
    graph buffers take the width): an MTP head's aux layers."""
    if config.speculative_method == "mtp":
        from engine.models.mtp import head_aux_layers
        model.set_aux_layers(head_aux_layers(config.model, model.config.num_hidden_layers,
                                             config.speculative_model))


def build_speculative_worker(engine):
    """The SpeculativeWorker for engine.config.speculative_method."""
    method = engine.config.speculative_method
    if method not in _METHODS:
        raise ValueError(f"unknown speculative_method {method!r}; available: "
                         f"{', '.join(speculative_methods())}")
    module, fn = _METHODS[method].split(":")
    return getattr(importlib.import_module(module), fn)(engine)
