"""launch.healthcheck (the image's HEALTHCHECK): which role and address it finds in a pdserve
command line, and real probes against a real gRPC health server and a real HTTP server on
loopback."""

from __future__ import annotations

import http.server
import threading
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from launch import healthcheck
from launch.healthcheck import HealthTarget, pdserve_argv, probe_address, target_from_argv


@pytest.mark.parametrize("cmdline,argv", [
    (["pdserve", "router", "--http", "0.0.0.0:8000"], ["router", "--http", "0.0.0.0:8000"]),
    (["/opt/pdserve/bin/python", "/opt/pdserve/bin/pdserve", "decode"], ["decode"]),
    (["python", "-m", "launch.cli", "prefill", "--listen", ":1"], ["prefill", "--listen", ":1"]),
    (["sleep", "infinity"], None),
])
def test_pdserve_argv(cmdline, argv):
    assert pdserve_argv(cmdline) == argv


def test_probe_address():
    assert probe_address("0.0.0.0:8000") == "127.0.0.1:8000"
    assert probe_address(":50061") == "127.0.0.1:50061"
    assert probe_address("[::]:50071") == "[::1]:50071"
    assert probe_address("10.0.0.5:50071") == "10.0.0.5:50071"
    with pytest.raises(ValueError, match="HOST:PORT"):
        probe_address("localhost")


def test_targets_follow_the_cli_flags_and_env(monkeypatch):
    monkeypatch.delenv("PDSERVE_LISTEN", raising=False)
    assert target_from_argv(["router", "--http", "0.0.0.0:8080"]) == HealthTarget(
        "http", "127.0.0.1:8080", "router")
    assert target_from_argv(["prefill"]) == HealthTarget("grpc", "127.0.0.1:50061", "prefill")
    assert target_from_argv(["aggregated"]) == HealthTarget("grpc", "127.0.0.1:50081",
                                                            "aggregated")
    monkeypatch.setenv("PDSERVE_LISTEN", "0.0.0.0:6000")   # env-backed flags count too
    assert target_from_argv(["decode"]) == HealthTarget("grpc", "127.0.0.1:6000", "decode")
    assert target_from_argv(["up", "--http-port", "9000"]).address == "127.0.0.1:9000"
    assert target_from_argv(["models", "prepare"]).kind == "none"


@pytest.fixture
def grpc_health_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    server.stop(None)


def test_grpc_probe_follows_the_serving_status(grpc_health_server):
    servicer, port = grpc_health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert healthcheck.check_grpc(f"127.0.0.1:{port}", 3.0) == (True, "SERVING")
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert healthcheck.check_grpc(f"127.0.0.1:{port}", 3.0) == (False, "NOT_SERVING")


def test_grpc_probe_of_a_closed_port_fails():
    healthy, detail = healthcheck.check_grpc("127.0.0.1:1", 1.0)
    assert not healthy and detail.startswith("gRPC ")


@pytest.fixture
def http_health_server():
    state = {"status": 200}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            code = state["status"] if self.path == "/health" else 404
            self.send_response(code)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state, server.server_address[1]
    server.shutdown()
    server.server_close()


def test_http_probe_follows_health(http_health_server):
    state, port = http_health_server
    assert healthcheck.check_http(f"127.0.0.1:{port}", 3.0) == (True, "HTTP 200")
    state["status"] = 503
    assert healthcheck.check_http(f"127.0.0.1:{port}", 3.0) == (False, "HTTP 503")


def test_main_reads_the_command_line_file(tmp_path, http_health_server, capsys):
    state, port = http_health_server
    cmdline = tmp_path / "cmdline"
    cmdline.write_bytes(b"/opt/pdserve/bin/python\0/opt/pdserve/bin/pdserve\0router\0"
                        + f"--http\0000.0.0.0:{port}\0".encode())
    assert healthcheck.main(["--cmdline-file", str(cmdline)]) == 0
    assert f"healthy: router: GET http://127.0.0.1:{port}/health: HTTP 200" in \
        capsys.readouterr().out
    state["status"] = 503
    assert healthcheck.main(["--cmdline-file", str(cmdline)]) == 1


def test_main_is_unhealthy_for_a_bad_command_line(tmp_path, capsys):
    cmdline = tmp_path / "cmdline"
    cmdline.write_bytes(b"pdserve\0decode\0--bogus\0")
    assert healthcheck.main(["--cmdline-file", str(cmdline)]) == 1
    cmdline.write_bytes(b"bash\0")
    assert healthcheck.main(["--cmdline-file", str(cmdline)]) == 1
    assert healthcheck.main(["--cmdline-file", str(tmp_path / "missing")]) == 1
    assert "not a pdserve command" in capsys.readouterr().out
