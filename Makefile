# `make serve` on a fresh machine: sets up as below if needed, then serves the default model
# on 127.0.0.1:8000 (OpenAI-compatible API; `.venv/bin/vattn serve --help` lists the options).
# `make test` on a fresh machine: creates .venv, installs torch (the CPU wheel, alone and
# first), the project with its extras, builds the native library, fetches and converts the
# default model into a cache directory outside git, then runs the tests.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
TORCH := torch==2.13.0
STAMP := $(VENV)/.installed
NATIVE := vattn/libvattn_native.so
OPS := vattn/libvattn_ops.so

.PHONY: setup native model serve test lint bench clean

setup: $(STAMP) $(NATIVE) $(OPS) model

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet $(TORCH)
	$(PIP) install --quiet -e ".[serving,dev]"
	touch $@

native: $(NATIVE) $(OPS)

# The default model, converted once into $$VATTN_CACHE_DIR (default ~/.cache/vattn); a no-op after.
model: $(STAMP)
	$(PY) -m serving.model_store

$(NATIVE): native/vattn_native.c
	cc -O2 -Wall -Wextra -Werror -shared -fPIC -o $@ $< -ldl -lpthread

# vattn's CPU torch operators, built against the venv's torch for this machine's CPU.
OPS_SOURCES := native/ragged_attention.cpp native/int8_linear.cpp
$(OPS): $(OPS_SOURCES) $(STAMP)
	TORCH=$$($(PY) -c "import os, torch; print(os.path.dirname(torch.__file__))"); \
	c++ -O3 -march=native -ffast-math -fopenmp -std=c++20 -shared -fPIC -Wall -Wextra -Werror \
		-D_GLIBCXX_USE_CXX11_ABI=$$($(PY) -c "import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))") \
		-isystem $$TORCH/include -isystem $$TORCH/include/torch/csrc/api/include \
		-o $@ $(OPS_SOURCES) -L$$TORCH/lib -ltorch_cpu -lc10 -Wl,-rpath,$$TORCH/lib

serve: setup
	$(VENV)/bin/vattn serve $(SERVE_ARGS)

test: setup
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: setup
	$(PY) -m benchmarks.map_bandwidth
	$(PY) -m benchmarks.step_latency

clean:
	rm -rf $(VENV) $(NATIVE) $(OPS) .pytest_cache
