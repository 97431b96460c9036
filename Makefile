# Quick start: `make demo` and `make test` bootstrap .venv from requirements/lock.txt.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
WEB := mobile_bridge/web
WEB_STAMP := $(WEB)/node_modules/.installed
OUT ?= out

.PHONY: demo test bench clean

$(STAMP): pyproject.toml requirements/lock.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements/lock.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $@

# The browser client's pinned npm packages (onnxruntime-web, playwright-core), from the lock file.
$(WEB_STAMP): $(WEB)/package-lock.json
	cd $(WEB) && npm ci --no-audit --no-fund --loglevel=error
	touch $@

demo: $(STAMP)
	$(PY) samples/digits/run.py --out $(OUT)/digits

test: $(STAMP) $(WEB_STAMP)
	$(VENV)/bin/ruff check artifacts ondevice samples benchmarks tests
	$(PY) -m pytest -q

bench: $(STAMP) $(WEB_STAMP)
	$(VENV)/bin/odt bench
	$(PY) benchmarks/generation.py
	$(PY) benchmarks/runtime.py
	$(PY) benchmarks/federation.py
	$(PY) benchmarks/browser.py

clean:
	rm -rf $(VENV) $(OUT)
