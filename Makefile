# pagekv: `make test` and `make demo` set everything up themselves (a .venv in the repo).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.pagekv-installed

.PHONY: test lint demo bench-hash compile-check clean test-sglang

$(PY):
	python3 -m venv $(VENV)

# torch: a local CPU wheel is pinned here (2.13.0); an unpinned torch would pull GBs of CUDA.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $@

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test: lint
	$(PY) -m pytest -q

# SGLang 0.5.23 HiCache backend tests, in their own venv outside the repo (created on first use,
# reused while its stamp matches; scripts/engines/setup_sglang.sh). The checkout goes on
# PYTHONPATH; PAGEKV_REQUIRE_SGLANG=1 makes a missing SGLang a failure, not a skip.
test-sglang:
	@SGLANG_PY=$$(bash scripts/engines/setup_sglang.sh) && \
	PYTHONPATH=$(CURDIR) PAGEKV_REQUIRE_SGLANG=1 $$SGLANG_PY -m pytest -q -p no:cacheprovider \
		tests/engines/test_sglang.py

bench-hash: $(STAMP)
	$(PY) scripts/bench_hash.py

demo: $(STAMP)
	$(PY) scripts/demo.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
