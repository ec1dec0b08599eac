# Set-up lives here so a fresh clone needs one command per job (see README.md).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
PORT   ?= 50051

.PHONY: serve test bench bench-quick proto

# Create the virtualenv and install the project with its test extras (llama-cpp-python compiles
# from source the first time: about 4 minutes on 2 cores; pip caches the wheel afterwards).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/trio-shard serve --port $(PORT)

test: $(STAMP)
	$(BIN)/python -m compileall -q shard tests bench
	$(BIN)/python -m pytest

# Benchmarks (docs/benchmarks.md); BENCH_ARGS passes options, e.g. BENCH_ARGS="--threads 2".
BENCH_DEPS := $(BIN)/python -c "import matplotlib, fastapi, uvicorn, sse_starlette" 2>/dev/null || \
	$(BIN)/python -m pip install --quiet -e '.[bench]'

bench: $(STAMP)
	$(BENCH_DEPS)
	$(BIN)/python -m bench.decode_throughput $(BENCH_ARGS)

bench-quick: $(STAMP)
	$(BENCH_DEPS)
	$(BIN)/python -m bench.decode_throughput --quick $(BENCH_ARGS)

proto: $(STAMP)
	$(BIN)/python -m shard.rpc.codegen
