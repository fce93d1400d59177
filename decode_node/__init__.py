"""Decode node of PD PUSH mode: reservations, KV receive, the decode loop, token streams."""
