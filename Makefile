# Quick start: `make demo` and `make test` bootstrap .venv from requirements/lock.txt: the newest CPython here that
# the lock supports (3.13, 3.12, then 3.11; on PATH or under pyenv), stock onnxruntime, the portable engine. The
# classic engine's tests run in .venv-classic (requirements/classic-lock.txt: ONNX Runtime's training build, which
# installs on CPython 3.11 only); without CPython 3.11, the default run's summary says in one line that they did not
# run (tests/conftest.py).
find_python = $(firstword $(foreach v,$(1),$(shell for p in python$(v) $${PYENV_ROOT:-$$HOME/.pyenv}/versions/$(v).*/bin/python; \
  do "$$p" -c "" >/dev/null 2>&1 && { echo "$$p"; break; }; done)))
ifeq ($(origin PYTHON),undefined)
PYTHON := $(or $(call find_python,3.13 3.12 3.11),python3)
endif
ifeq ($(origin CLASSIC_PYTHON),undefined)
CLASSIC_PYTHON := $(call find_python,3.11)
endif
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CLASSIC_VENV := .venv-classic
CLASSIC_STAMP := $(CLASSIC_VENV)/.installed
WEB := mobile_bridge/web
WEB_STAMP := $(WEB)/node_modules/.installed
OUT ?= out

.PHONY: demo test check bench clean chromium arm64 wheel nextword assistant kernels

$(STAMP): pyproject.toml requirements/lock.txt requirements/no-deps.txt
	$(PYTHON) -m venv --clear $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements/lock.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -r requirements/no-deps.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $@

$(CLASSIC_STAMP): pyproject.toml requirements/classic-lock.txt requirements/no-deps.txt
	$(CLASSIC_PYTHON) -m venv --clear $(CLASSIC_VENV)
	$(CLASSIC_VENV)/bin/python -m pip install --quiet --disable-pip-version-check -r requirements/classic-lock.txt
	$(CLASSIC_VENV)/bin/python -m pip install --quiet --disable-pip-version-check --no-deps -r requirements/no-deps.txt
	$(CLASSIC_VENV)/bin/python -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $@

# The browser client's pinned npm packages (onnxruntime-web, its 1.19.2 training build, playwright-core), from
# the lock file; the onnxruntime-web files the client loads go to $(WEB)/ort, which the wheel ships: the current
# WASM and WebGPU builds (portable step graphs) and 1.19.2's training build (classic graphs).
ORT_DIST := $(WEB)/node_modules/onnxruntime-web/dist
ORT_TRAINING_DIST := $(WEB)/node_modules/onnxruntime-web-training/dist
$(WEB_STAMP): $(WEB)/package-lock.json
	@command -v npm >/dev/null 2>&1 || { echo "the browser client's files come from npm: install Node.js and npm (Debian: apt-get install -y npm), then run make again" >&2; exit 1; }
	cd $(WEB) && npm ci --no-audit --no-fund --loglevel=error
	rm -rf $(WEB)/ort && mkdir -p $(WEB)/ort
	cp $(ORT_DIST)/ort.wasm.min.mjs $(ORT_DIST)/ort-wasm-simd-threaded.mjs $(ORT_DIST)/ort-wasm-simd-threaded.wasm $(WEB)/ort/
	cp $(ORT_DIST)/ort.min.mjs $(ORT_DIST)/ort-wasm-simd-threaded.jsep.mjs $(ORT_DIST)/ort-wasm-simd-threaded.jsep.wasm \
	   $(WEB)/ort/  # WebGPU (and WASM)
	cp $(ORT_TRAINING_DIST)/ort.training.wasm.min.mjs $(ORT_TRAINING_DIST)/ort-training-wasm-simd-threaded.mjs \
	   $(ORT_TRAINING_DIST)/ort-training-wasm-simd-threaded.wasm $(WEB)/ort/
	cp $(WEB)/node_modules/onnxruntime-web/package.json $(WEB)/ort/onnxruntime-web.package.json  # versions, MIT licence
	cp $(WEB)/node_modules/onnxruntime-web-training/package.json $(WEB)/ort/onnxruntime-web-training.package.json
	touch $@

# The portable engine's update kernel for each platform it ships on (_build/kernels.py: ziglang's C compiler, from
# the lock), rebuilt when ondevice/kernels/update.c is newer than a library.
kernels: $(STAMP)
	$(PY) _build/kernels.py

# The next-word sample (LSTM per home, federated with a personal output layer): a few minutes, not in `make demo`.
nextword: $(STAMP) kernels
	$(PY) -m samples.nextword.run --out $(OUT)/nextword --federated 3 --shared-rounds 24

# The assistant sample (SmolLM2 + LoRA on a home's commands, then federated across homes): about
# 15 minutes on 2 cores and 8 GB for its generate step, not in `make demo`.
assistant: $(STAMP) kernels
	$(PY) -m samples.assistant.run --out $(OUT)/assistant --federated 2

demo: $(STAMP) kernels
	$(PY) -m samples.digits.run --out $(OUT)/digits
	$(PY) -m samples.intents.run --out $(OUT)/intents --federated 2

# The browser tests drive Debian's Chromium: installed here when running as root, else one line saying how.
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing Debian's chromium for the browser tests"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else \
	    echo "make test needs Chromium for the browser tests: run 'sudo apt-get install -y chromium', then make test again" >&2; \
	    exit 1; \
	  fi; }

# The arm64 test runs Debian arm64 under qemu-user: Debian's qemu-user-static and debootstrap, and the kernel's
# binfmt_misc handler for aarch64 (set up here when running as root, else one line saying how).
arm64:
	@{ command -v qemu-aarch64-static >/dev/null 2>&1 && command -v debootstrap >/dev/null 2>&1; } || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing Debian's qemu-user-static and debootstrap for the arm64 test"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user-static debootstrap \
	      binfmt-support >/dev/null; \
	  else \
	    echo "make test needs arm64 emulation: run 'sudo apt-get install -y qemu-user-static debootstrap binfmt-support', then make test again" >&2; \
	    exit 1; \
	  fi; }
	@[ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    [ -e /proc/sys/fs/binfmt_misc/register ] || mount binfmt_misc -t binfmt_misc /proc/sys/fs/binfmt_misc; \
	    update-binfmts --enable qemu-aarch64; \
	  else \
	    echo "make test needs the aarch64 binfmt handler: run 'sudo update-binfmts --enable qemu-aarch64', then make test again" >&2; \
	    exit 1; \
	  fi; }

# Everything CI runs: lint, every test (real Flower processes, headless Chromium, wheel installs on other
# Pythons and on arm64 under emulation, the docs site built with --strict), and the 15 slowest tests listed; then the
# classic engine's tests in .venv-classic where CPython 3.11 exists.
test: $(STAMP) kernels $(WEB_STAMP) chromium arm64 $(if $(CLASSIC_PYTHON),$(CLASSIC_STAMP))
	$(VENV)/bin/ruff check artifacts ondevice federated mobile_bridge samples benchmarks tests
	$(PY) -m pytest -q --durations=15 -m "not classic"
ifneq ($(CLASSIC_PYTHON),)
	$(CLASSIC_VENV)/bin/python -m pytest -q --durations=5 -m classic
endif

# The edit loop's subset: no Flower processes, no browser, no wheel builds.
check: $(STAMP) kernels
	$(VENV)/bin/ruff check artifacts ondevice federated mobile_bridge samples benchmarks tests
	$(PY) -m pytest -q -m "not slow and not browser and not flower" -x

# Benchmarks set the engines side by side: they run where both are installed (.venv-classic).
bench: PY := $(CLASSIC_VENV)/bin/python
bench: $(CLASSIC_STAMP) $(WEB_STAMP)
	$(PY) _build/kernels.py  # (not the kernels target: this PY would reach .venv's recipe)
	$(PY) -m benchmarks
	$(PY) -m benchmarks.generation
	$(PY) -m benchmarks.gradient_builder --smollm2
	$(PY) -m benchmarks.runtime
	$(PY) -m benchmarks.cnn
	$(PY) -m benchmarks.transformer
	$(PY) -m benchmarks.federation
	$(PY) -m benchmarks.fl_sweep
	$(PY) -m benchmarks.browser
	$(PY) -m benchmarks.faults
	$(PY) -m benchmarks.red_team
	$(PY) -m benchmarks.finetune
	$(PY) -m benchmarks.engines

# The distribution users install (dist/ondevice_training-*.whl), with the vendored browser files: any supported
# $(PYTHON) and npm, no development venv (pip fetches setuptools into an isolated build environment).
wheel: $(WEB_STAMP)
	rm -rf build
	$(PYTHON) -m pip wheel --quiet --disable-pip-version-check --no-deps . -w dist
	rm -rf build

clean:
	rm -rf $(VENV) $(CLASSIC_VENV) $(OUT)
