# Fresh machine: `make demo` (installs, then runs the demo) and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
UNAME  := $(shell uname -s)
# The system OpenBLAS, preloaded for tests on Linux (the CLI preloads it itself).
OPENBLAS = $(firstword $(wildcard /usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0))

.PHONY: install demo demo-models bench test lint bench-plain clean openblas

install: $(STAMP)

$(STAMP): pyproject.toml
	@$(MAKE) --no-print-directory openblas
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
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

demo: install
	$(PY) -m specstream_mlx.demo.run

test: install
	LD_PRELOAD="$(OPENBLAS)" $(PY) -m pytest -q

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Rebuild the bundled demo models from scratch (about 100 minutes on a 2-core CPU; needs
# the dev extras, PyTorch included, which `make install` installs).
demo-models: install
	LD_PRELOAD="$(OPENBLAS)" $(PY) -m specstream_mlx.demo.build sql chat

bench: install
	$(VENV)/bin/specstream-mlx bench --model demo-sql --json bench/bench-demo-sql.json
	$(VENV)/bin/specstream-mlx bench --model demo-chat --json bench/bench-demo-chat.json

bench-plain: install
	$(PY) examples/bench_plain.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
