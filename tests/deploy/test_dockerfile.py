"""deploy/docker/Dockerfile, read (no Docker engine here): it pins the torch the project pins,
runs as the non-root user the manifests expect, exposes the CLI's default ports, its
HEALTHCHECK and ENTRYPOINT exist in the code, and .dockerignore keeps the packages in."""

from __future__ import annotations

import fnmatch
import importlib
import json
import re
import tomllib

import pytest

from tests.deploy.manifests import REPO, workloads

DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, parts = [], []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or not stripped:
            continue
        if stripped.endswith("\\"):
            parts.append(stripped[:-1].strip())
            continue
        joined = " ".join([*parts, stripped])
        parts = []
        word, _, rest = joined.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


@pytest.fixture(scope="module")
def docker() -> list[tuple[str, str]]:
    return instructions(DOCKERFILE.read_text())


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _args(docker, word):
    return [rest for w, rest in docker if w == word]


def test_torch_pin_matches_pyproject(docker, pyproject):
    pins = [d for d in pyproject["project"]["dependencies"] if d.startswith("torch")]
    assert pins == ["torch==2.13.0"]
    runs = " ".join(_args(docker, "RUN"))
    assert '"torch==2.13.0"' in runs


def test_runs_as_the_non_root_user_the_pods_use(docker, rendered):
    uid = next(re.match(r"UID=(\d+)", a).group(1) for a in _args(docker, "ARG")
               if a.startswith("UID="))
    assert _args(docker, "USER") == ["${UID}:${UID}"]
    assert int(uid) != 0
    for w, template in workloads(rendered["base"]):
        if w["metadata"]["name"] != "pdserve-etcd":
            assert template["spec"]["securityContext"]["runAsUser"] == int(uid)


def test_entrypoint_and_healthcheck_exist_in_the_code(docker, pyproject):
    assert json.loads(_args(docker, "ENTRYPOINT")[0]) == ["pdserve"]
    assert pyproject["project"]["scripts"]["pdserve"] == "launch.cli:main"
    healthcheck = _args(docker, "HEALTHCHECK")[0]
    command = json.loads(healthcheck.split(" CMD ", 1)[1])
    assert command[:2] == ["python", "-m"]
    assert callable(importlib.import_module(command[2]).main)


def test_exposes_the_cli_default_ports(docker):
    from launch.cli import build_parser

    parser = build_parser()
    defaults = {parser.parse_args(["router"]).http, parser.parse_args(["router"]).grpc,
                parser.parse_args(["prefill"]).listen, parser.parse_args(["decode"]).listen}
    ports = {int(a.rpartition(":")[2]) for a in defaults}
    assert {int(p) for p in _args(docker, "EXPOSE")[0].split()} == ports


def test_every_build_arg_is_declared(docker):
    declared = {a.split("=")[0] for a in _args(docker, "ARG")}
    used = set(re.findall(r"\$\{([A-Z_]+)\}", DOCKERFILE.read_text()))
    env_names = {m for w, a in docker if w == "ENV" for m in re.findall(r"([A-Z_]+)=", a)}
    assert used - env_names - {"PATH"} <= declared


def test_dockerignore_keeps_what_pip_install_needs(pyproject):
    patterns = [p.strip() for p in (REPO / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    include = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = [p.rstrip("*") for p in include]
    needed = ["pyproject.toml", "README.md", *packages]
    for path in needed:
        assert not any(fnmatch.fnmatch(path, p) for p in patterns), f"{path} is ignored"
    for pkg in packages:
        assert (REPO / pkg).is_dir(), pkg
    assert ".git" in patterns and ".venv" in patterns
