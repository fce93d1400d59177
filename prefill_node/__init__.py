"""Prefill node of PD PUSH mode: prefill with the layer-wise KV push to a decode node."""
