"""CPU kernel builds cannot hang a process: the build lock (an flock, freed by the kernel
when its holder dies) is waited on for a bounded time, then refused with a message naming
the lock and its holder; torch's own leftover lock file is removed; a node loads its
kernels before it is built and serves."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from engine.layers import cpu_extension
from engine.layers.cpu_extension import LOCK_NAME, KernelBuildLockTimeout, build_lock

HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, f"{os.getpid()}\\n".encode())
print("held", flush=True)
sys.stdin.read()            # hold until the test closes stdin (or kills us)
"""


@pytest.fixture
def holder(tmp_path):
    """A live process holding the build lock of tmp_path/build, as a building node does."""
    build = tmp_path / "build"
    build.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(build / LOCK_NAME)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    yield build, proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def test_a_live_holder_is_waited_for_then_refused_with_the_lock_and_its_holder(holder):
    build, proc = holder
    with pytest.raises(KernelBuildLockTimeout) as err:
        with build_lock(build, timeout=0.3, what="test kernel"):
            pytest.fail("acquired a lock another live process holds")
    message = str(err.value)
    assert str(build / LOCK_NAME) in message and f"pid {proc.pid}" in message
    assert "stop it" in message and "PDSERVE_KERNEL_BUILD_TIMEOUT" in message


def test_a_waiter_gets_the_lock_once_the_build_ends_or_its_holder_is_killed(holder):
    build, proc = holder
    acquired = threading.Event()

    def wait_for_it():
        with build_lock(build, timeout=60):
            acquired.set()

    waiter = threading.Thread(target=wait_for_it)
    waiter.start()
    assert not acquired.wait(0.3)          # still held: the waiter waits
    proc.kill()                            # a build killed mid-way: the kernel frees it
    waiter.join(60)
    assert acquired.is_set()
    with build_lock(build, timeout=1) as path:     # and it is free again afterwards
        assert path.read_text().split()[0].isdigit()


def test_torch_lock_file_left_by_a_killed_build_is_removed(tmp_path):
    baton = tmp_path / "lock"            # torch's FileBaton, which it would wait on forever
    baton.touch()
    with build_lock(tmp_path, timeout=1):
        assert not baton.exists()


def _kernels(tmp_path, body: str) -> cpu_extension.CpuKernels:
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "a.cpp").write_text(body)
    return cpu_extension.CpuKernels(csrc=src, sources={"a.cpp": []}, headers=(),
                                    namespace="pdserve_test")


def test_extension_load_raises_instead_of_hanging_and_keeps_no_failure(holder, monkeypatch,
                                                                       tmp_path):
    build, _ = holder
    kernels = _kernels(tmp_path, "int f() { return 1; }")
    monkeypatch.setattr(kernels, "build_dir", lambda: build)
    monkeypatch.setattr(kernels, "_build",
                        lambda d: pytest.fail("built while another process holds the lock"))
    assert kernels.build_name().startswith("pdserve_cpu_")
    with pytest.raises(KernelBuildLockTimeout, match="CPU kernels"):
        kernels.load(build_lock_timeout=0.2)
    assert kernels.failed is None and kernels.ops is None   # the next start tries again


def test_build_folder_names_differ_by_source(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = _kernels(tmp_path / "a", "int f() { return 1; }")
    b = _kernels(tmp_path / "b", "int f() { return 2; }")
    assert a.build_name() != b.build_name() and a.build_name() == a.build_name()


def test_a_source_that_does_not_compile_is_reported_with_the_compiler_error(tmp_path):
    kernels = _kernels(tmp_path, "int f() { return undeclared_name; }")
    assert kernels.load() is None
    assert "undeclared_name" in kernels.failed and kernels.ops is None


def test_node_loads_its_kernels_before_the_node_is_built(monkeypatch):
    from launch import node_main
    from launch.cli import build_parser
    from launch.cli_common import CliError

    order: list[str] = []
    monkeypatch.setattr(cpu_extension, "preload",
                        lambda options: order.append(f"kernels:{options.cpu_fused_ops}") or {})
    monkeypatch.setattr(node_main, "build_node", lambda role, args, node_id:
                        order.append("build") or object())

    async def serve(role, node, args, node_id):
        order.append("serve")
        return 0

    monkeypatch.setattr(node_main, "serve", serve)
    # the real parser's Namespace: run_node reads more flags as nodes grow
    args = build_parser().parse_args(["decode", "--node-id", "d0", "--device", "cpu"])
    assert node_main.run_node("decode", args) == 0
    assert order == ["kernels:True", "build", "serve"]

    def stuck(options):
        raise KernelBuildLockTimeout("the build lock /x/pdserve-build.lock is still held")

    monkeypatch.setattr(cpu_extension, "preload", stuck)
    with pytest.raises(CliError, match="pdserve-build.lock"):
        node_main.run_node("decode", args)


def test_lock_timeout_reads_the_environment(monkeypatch):
    monkeypatch.setenv("PDSERVE_KERNEL_BUILD_TIMEOUT", "12")
    assert cpu_extension.lock_timeout() == 12.0
    monkeypatch.setenv("PDSERVE_KERNEL_BUILD_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="PDSERVE_KERNEL_BUILD_TIMEOUT"):
        cpu_extension.lock_timeout()
