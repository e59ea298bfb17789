# Every target sets up its own virtualenv on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tfuture-installed

.PHONY: test perf lint soak demo demo-hf clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# Pinned for the dev environment only: torch==2.13.0 is the CPU wheel on these machines.
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e '.[dev,perf,hf,grammar]'
	touch $@

test: $(STAMP)
	$(PY) -m pytest -q

# make perf writes perf/results/<device>-local/ (untracked); make perf-refresh (or
# PERF_REFRESH=1 make perf) rewrites the committed perf/results/<device>/.
perf: $(STAMP)
	$(PY) -m perf

.PHONY: perf-refresh
perf-refresh: $(STAMP)
	PERF_REFRESH=1 $(PY) -m perf

# The full soak: 100,000 steps on the CPU backend (make test runs a 5,000-step version).
soak: $(STAMP)
	$(PY) tests/reliability/soak.py --steps 100000

# The committed mutation set (tests/mutants/mutants.py), each mutant on a temporary copy of the
# package against its owning tests; fails if one survives or went stale. Not part of make test.
.PHONY: mutants
mutants: $(STAMP)
	$(PY) tests/mutants/run.py

demo: $(STAMP)
	$(PY) -m tfuture.testing.demo

# Tensor / pipeline parallel over 2 local ranks (gloo on CPU, NCCL on GPUs); no activated venv needed.
TORCHRUN := $(PY) -m torch.distributed.run
.PHONY: demo-tp demo-pp
demo-tp: $(STAMP)
	$(TORCHRUN) --nproc-per-node 2 -m tfuture.testing.demo --tp 2

demo-pp: $(STAMP)
	$(TORCHRUN) --nproc-per-node 2 -m tfuture.testing.demo --pp 2

# A small random-weight Hugging Face Llama through the runtime: sync vs overlap.
demo-hf: $(STAMP)
	$(PY) -m tfuture.examples.hf

lint: $(STAMP)
	$(VENV)/bin/ruff check tfuture tests perf
	$(VENV)/bin/ruff format --check tfuture tests perf
	$(VENV)/bin/mypy tfuture

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache build dist
