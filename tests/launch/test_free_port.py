"""launch/etcd_server.py free_port: a port for a process started next to listen on, outside
the kernel's ephemeral range (where outgoing connections and port-0 listeners could take it
before that process binds), bindable when picked, never handed out twice."""

from __future__ import annotations

import socket

from launch.etcd_server import ephemeral_low, free_port


def test_ports_are_below_the_ephemeral_range_bindable_and_distinct():
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p < ephemeral_low() for p in ports)
    for p in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_in_use_is_not_picked(monkeypatch):
    import launch.etcd_server as es

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        picks = iter([taken, taken + 1 if taken + 1 < 65536 else taken - 1])

        class Rng:
            def randrange(self, a, b):
                return next(picks)

        monkeypatch.setattr(es.random, "SystemRandom", Rng)
        monkeypatch.setattr(es, "_handed_out", set())
        assert free_port() != taken
