"""`pdserve prefill|decode` flags -> EngineConfig (graph and speculative options), env
fallbacks, and clear errors for bad values; `pdserve up` hands them to the right nodes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from launch.cli import build_parser
from launch.cli_common import CliError
from launch.commands.node_options import engine_config_from_args
from launch.commands.up import core_share_wanted, speculative_args


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


def config(*argv: str):
    return engine_config_from_args(parse("decode", "--model", "/m", *argv))


def test_defaults_keep_graph_and_speculation_off():
    c = config()
    assert (c.enable_graph, c.graph_max_batch_size) == (False, None)
    assert (c.speculative_method, c.num_speculative_tokens, c.speculative_model) == \
        (None, 1, None)


def test_flags_reach_engine_config():
    c = config("--enable-graph", "--graph-max-batch-size", "8", "--speculative-method", "MTP",
               "--num-speculative-tokens", "3", "--speculative-model", "/draft")
    assert (c.enable_graph, c.graph_max_batch_size) == (True, 8)
    assert (c.speculative_method, c.num_speculative_tokens, c.speculative_model) == \
        ("mtp", 3, "/draft")
    assert config("--speculative-method", "none").speculative_method is None


def test_nodes_prefault_their_kv_cache_unless_told_not_to(monkeypatch):
    assert config().prefault_memory is True
    assert config("--no-prefault-memory").prefault_memory is False
    monkeypatch.setenv("PDSERVE_PREFAULT_MEMORY", "0")
    c = engine_config_from_args(build_parser().parse_args(["prefill", "--model", "/m"]))
    assert c.prefault_memory is False


def test_nodes_use_huge_pages_unless_told_not_to(monkeypatch):
    assert config().huge_pages is True
    assert config("--no-huge-pages").huge_pages is False
    monkeypatch.setenv("PDSERVE_HUGE_PAGES", "0")
    c = engine_config_from_args(build_parser().parse_args(["decode", "--model", "/m"]))
    assert c.huge_pages is False


def test_env_variables_are_read(monkeypatch):
    monkeypatch.setenv("PDSERVE_ENABLE_GRAPH", "1")
    monkeypatch.setenv("PDSERVE_SPECULATIVE_METHOD", "mtp")
    monkeypatch.setenv("PDSERVE_NUM_SPECULATIVE_TOKENS", "2")
    monkeypatch.setenv("PDSERVE_GRAPH_MAX_BATCH_SIZE", "4")
    c = engine_config_from_args(build_parser().parse_args(["prefill", "--model", "/m"]))
    assert (c.enable_graph, c.graph_max_batch_size, c.speculative_method,
            c.num_speculative_tokens) == (True, 4, "mtp", 2)


def test_bad_values_are_named():
    with pytest.raises(SystemExit):          # argparse usage error (exit 2)
        parse("decode", "--speculative-method", "eagle")
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer in"):
        config("--speculative-method", "mtp", "--num-speculative-tokens", "0")
    with pytest.raises(ValueError, match="graph_max_batch_size must be >= 1"):
        config("--enable-graph", "--graph-max-batch-size", "0")
    with pytest.raises(ValueError, match="speculative_model needs speculative_method"):
        config("--speculative-model", "/draft")


def test_bad_env_value_is_a_cli_error(monkeypatch):
    monkeypatch.setenv("PDSERVE_SPECULATIVE_METHOD", "medusa")
    with pytest.raises(CliError, match="PDSERVE_SPECULATIVE_METHOD='medusa'"):
        build_parser()


def test_bad_value_exits_2_with_one_line(capsys):
    from launch.cli import main
    assert main(["decode", "--model", "/nonexistent", "--etcd", "none",
                 "--num-speculative-tokens", "99", "--speculative-method", "mtp"]) == 2
    err = capsys.readouterr().err
    assert "num_speculative_tokens must be an integer in [1, 16]" in err


def _up_config(monkeypatch, *argv: str):
    """The LocalClusterConfig `pdserve up` builds from its flags (nothing is started)."""
    from launch import local_cluster
    from launch.commands import up
    from router.model_info import ModelInfo

    class Built(Exception):
        pass

    def capture(config):
        raise Built(config)

    monkeypatch.setattr(ModelInfo, "from_folder",
                        classmethod(lambda cls, folder, **kw: SimpleNamespace(name="m")))
    monkeypatch.setattr(local_cluster, "LocalCluster", capture)
    with pytest.raises(Built) as built:
        up.run(parse("up", "--model", "/m", *argv))
    return built.value.args[0]


def _mtp_and_graph_flags(args: list[str]) -> list[str]:
    keep = {"--speculative-method", "--num-speculative-tokens", "--enable-graph"}
    return [a for i, a in enumerate(args)
            if a in keep or (i > 0 and args[i - 1] in keep - {"--enable-graph"})]


def test_up_passes_mtp_to_both_roles_and_graphs_to_decode(monkeypatch):
    mtp = ["--speculative-method", "mtp", "--num-speculative-tokens", "2"]
    c = _up_config(monkeypatch, "--enable-graph", *mtp)
    assert _mtp_and_graph_flags(c.prefill_args) == mtp                 # no graphs on prefill
    assert _mtp_and_graph_flags(c.decode_args) == mtp + ["--enable-graph"]
    assert _mtp_and_graph_flags(c.node_args) == []                     # not on every node
    c = _up_config(monkeypatch, "--aggregated", "--enable-graph", *mtp)
    assert _mtp_and_graph_flags(c.aggregated_args) == mtp + ["--enable-graph"]
    c = _up_config(monkeypatch)                                         # neither by default
    assert _mtp_and_graph_flags(c.prefill_args + c.decode_args + c.aggregated_args) == []
    with pytest.raises(CliError, match="--num-speculative-tokens"):
        speculative_args(parse("up", "--speculative-method", "mtp",
                               "--num-speculative-tokens", "0"))


def test_local_cluster_puts_role_flags_on_the_right_nodes(tmp_path, monkeypatch):
    from launch import local_cluster
    from launch.local_cluster import LocalCluster, LocalClusterConfig

    started = []
    monkeypatch.setattr(local_cluster.Child, "start", lambda self, env: started.append(self)
                        or self)
    lc = LocalCluster(LocalClusterConfig(model="/m", run_dir=tmp_path,
                                         prefill_args=["--speculative-method", "mtp"],
                                         decode_args=["--enable-graph"]))
    monkeypatch.setattr(type(lc.etcd), "endpoint", property(lambda self: "127.0.0.1:1"))
    lc.add_node("prefill")
    lc.add_node("decode")
    pre, dec = (c.cmd for c in started)
    assert "--speculative-method" in pre and "--enable-graph" not in pre
    assert "--enable-graph" in dec and "--speculative-method" not in dec


def test_up_makes_cpu_nodes_take_turns_unless_told_not_to(tmp_path, monkeypatch):
    from launch import local_cluster
    from launch.local_cluster import LocalCluster, LocalClusterConfig

    assert core_share_wanted(parse("up"))
    assert not core_share_wanted(parse("up", "--no-core-share"))
    assert not core_share_wanted(parse("up", "--device", "cuda"))
    started = []
    monkeypatch.setattr(local_cluster.Child, "start", lambda self, env: started.append(self)
                        or self)
    for share in (True, False):
        lc = LocalCluster(LocalClusterConfig(model="/m", run_dir=tmp_path / str(share),
                                             num_aggregated=1, core_share=share))
        monkeypatch.setattr(type(lc.etcd), "endpoint", property(lambda self: "127.0.0.1:1"))
        for role in ("prefill", "decode", "aggregated"):
            lc.add_node(role)
    lock = str(tmp_path / "True" / "cores.lock")
    for child in started[:3]:                     # one lock file for every node
        assert child.cmd[child.cmd.index("--core-share-lock") + 1] == lock
    assert all("--core-share-lock" not in child.cmd for child in started[3:])
    assert parse("decode", "--core-share-lock", lock).core_share_lock == lock


def test_tensor_parallel_size_reaches_the_engine_and_up_gives_it_to_every_node(
        monkeypatch):
    assert config().tensor_parallel_size == 1
    assert config("--tensor-parallel-size", "2").tensor_parallel_size == 2
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        config("--tensor-parallel-size", "0")
    c = _up_config(monkeypatch, "--tensor-parallel-size", "2")
    i = c.node_args.index("--tensor-parallel-size")
    assert c.node_args[i + 1] == "2"                       # every role's flags
    monkeypatch.setenv("PDSERVE_TENSOR_PARALLEL_SIZE", "4")
    assert config().tensor_parallel_size == 4


@pytest.mark.parametrize("role", ["prefill", "decode", "aggregated"])
def test_step_budget_default_is_the_roles(role, monkeypatch):
    """A prefill node takes twice the token budget of a node that decodes (it has no decode
    rows waiting on its steps); a flag or the env variable still sets it for any role."""
    from launch.commands.node_options import MAX_NUM_BATCHED_TOKENS, ROLE_MAX_NUM_BATCHED_TOKENS

    monkeypatch.delenv("PDSERVE_MAX_NUM_BATCHED_TOKENS", raising=False)
    default = engine_config_from_args(parse(role, "--model", "/m")).max_num_batched_tokens
    assert default == ROLE_MAX_NUM_BATCHED_TOKENS.get(role, MAX_NUM_BATCHED_TOKENS)
    assert (default > MAX_NUM_BATCHED_TOKENS) == (role == "prefill")
    flag = parse(role, "--model", "/m", "--max-num-batched-tokens", "1024")
    assert engine_config_from_args(flag).max_num_batched_tokens == 1024
    monkeypatch.setenv("PDSERVE_MAX_NUM_BATCHED_TOKENS", "3000")
    assert engine_config_from_args(parse(role, "--model", "/m")).max_num_batched_tokens == 3000
