# Quick start: `make demo` and `make test` bootstrap .venv from requirements/lock.txt.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
OUT ?= out

.PHONY: demo test bench clean

$(STAMP): pyproject.toml requirements/lock.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements/lock.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $@

demo: $(STAMP)
	$(PY) samples/digits/run.py --out $(OUT)/digits

test: $(STAMP)
	$(VENV)/bin/ruff check artifacts ondevice samples benchmarks tests
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/generation.py
	$(PY) benchmarks/runtime.py
	$(PY) benchmarks/federation.py

clean:
	rm -rf $(VENV) $(OUT)
