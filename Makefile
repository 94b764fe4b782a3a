SHELL := /bin/bash
# One command per job. `make test` and `make demo` work on a fresh clone: they bootstrap .venv.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell sha256sum pyproject.toml | cut -c1-12)
PYTEST := $(PY) -m pytest

.PHONY: venv native test test-core test-engines engine-envs lint demo bench fuzz clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]' 2> >(grep -v "is ignored" >&2)
	rm -f $(VENV)/.installed-*
	touch $@

# The router's pure layers compiled with mypyc, into ~/.cache/kvmesh/native (built once per source
# digest; a machine without a C compiler runs them as Python).
native: venv
	$(VENV)/bin/kvmesh native build --if-possible

# Every test: the core suite in .venv, then the engine tiers in their cached environments.
test: test-core test-engines

# The suite runs on the compiled layers where they were built; their own tests then run again as
# Python, the fallback every machine without a C compiler runs.
test-core: venv native
	$(PYTEST) -m "not engine_vllm and not engine_sglang" -p no:cacheprovider --ignore=tests/engines
	if $(VENV)/bin/kvmesh native status >/dev/null; then \
		KVMESH_NATIVE=0 $(PYTEST) -p no:cacheprovider -q tests/router/core tests/router/request; fi

# Engine environments live in ~/.cache/kvmesh/envs (built once, keyed by recipe).
engine-envs:
	scripts/engine-env.sh vllm >/dev/null
	scripts/engine-env.sh sglang >/dev/null

test-engines: venv
	PYTHONPATH=$(CURDIR) $$(scripts/engine-env.sh vllm) -m pytest -m engine_vllm -p no:cacheprovider tests/engines/test_*vllm*.py
	PYTHONPATH=$(CURDIR) $$(scripts/engine-env.sh sglang) -m pytest -m engine_sglang -p no:cacheprovider tests/engines/test_*sglang*.py

# The long fuzz run (docs/RELIABILITY.md): FUZZ_EXAMPLES cases per target and surface (36 of them),
# figures appended to fuzz-report.jsonl (cases, statuses, 5xx, RSS before/after each run).
FUZZ_EXAMPLES ?= 6000
fuzz: venv
	rm -f fuzz-report.jsonl
	KVMESH_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) KVMESH_FUZZ_REPORT=$(CURDIR)/fuzz-report.jsonl \
		$(PYTEST) tests/fuzz -p no:cacheprovider -q --timeout=0
	cat fuzz-report.jsonl

lint: venv
	$(PY) -m ruff check kvmesh tests benchmarks examples scripts
	$(PY) -m ruff format --check kvmesh tests benchmarks examples scripts
	$(PY) -m mypy

demo: venv
	$(VENV)/bin/kvmesh demo

bench: venv
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev,bench]' 2> >(grep -v "is ignored" >&2)
	$(PY) benchmarks/hashing.py
	$(PY) benchmarks/wire.py
	$(PY) benchmarks/router_core.py
	$(PY) benchmarks/mock_engine.py
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/relay.py
	$(PY) benchmarks/front_latency.py
	$(PY) benchmarks/burst_joins.py --trials 6
	$(PY) benchmarks/prompt_batches.py --tasks 48 --context-words 1500 --batches 32
	$(PY) benchmarks/pooling.py
	$(PY) benchmarks/routing_quality.py --short

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
