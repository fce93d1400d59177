"""--cpu-threads: a node's torch threads on a CPU device (nodes sharing a machine's cores
take a share each), from the flag to EngineConfig to the Device, and bad values named."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.device import Device
from launch.cli import build_parser
from launch.commands.node_options import engine_config_from_args


def _config(*argv: str) -> EngineConfig:
    return engine_config_from_args(build_parser().parse_args(["decode", "--model", "/m",
                                                              *argv]))


def test_the_flag_and_its_env_variable_reach_the_engine_config(monkeypatch):
    assert _config().cpu_threads is None                     # 0: torch's default
    assert _config("--cpu-threads", "1").cpu_threads == 1
    monkeypatch.setenv("PDSERVE_CPU_THREADS", "3")
    assert _config().cpu_threads == 3


def test_bad_values_are_named():
    with pytest.raises(ValueError, match="cpu_threads must be an integer >= 1, got -2"):
        _config("--cpu-threads", "-2")
    with pytest.raises(ValueError, match="cpu_threads must be an integer >= 1"):
        EngineConfig(model="/m", cpu_threads=0)


def test_a_cpu_device_sets_torchs_threads_and_none_leaves_them():
    before = torch.get_num_threads()
    try:
        Device("cpu", cpu_threads=1)
        assert torch.get_num_threads() == 1
        torch.set_num_threads(3)                     # neither the flag's value nor a default
        Device("cpu")
        assert torch.get_num_threads() == 3          # None: left as it is
    finally:
        torch.set_num_threads(before)
