# pagekv: `make test` and `make demo` set everything up themselves (a .venv in the repo).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.pagekv-installed

.PHONY: test lint demo bench-hash compile-check clean

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
