# Two commands set everything up on a fresh machine: `make run` and `make test`.
# `make test-fast` leaves out the slow tests (browser, benchmarks, long runs): a few minutes.
VENV    ?= .venv
PY      := $(VENV)/bin/python
PIP     := $(VENV)/bin/pip
STAMP   := $(VENV)/.installed

.PHONY: install browser run test test-fast lint bench validate-gpu clean

$(PY):
	python3 -m venv $(VENV)

# torch==2.13.0 first: it takes the CPU wheel on this machine; any looser request would
# pull the newest CUDA build (several GB). The package's own range is satisfied by it.
# timm with --no-deps: it requires torchvision, whose only build for torch 2.13 is a CUDA
# one that does not load here (and would drag torch along); the bench extra lists timm's
# other requirements, and sample_models/timm_zoo.py imports it over a torchvision stub.
$(STAMP): $(PY) pyproject.toml
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps timm==1.0.31
	touch $(STAMP)

install: $(STAMP)

# Debian's chromium for the browser tests, installed when missing and we are root.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = "0" ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null; \
	  else echo "chromium is missing and we are not root: install Debian's chromium to run browser tests"; fi; }

run: install
	$(VENV)/bin/remat app

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# every test, the slow ones (browser included) too, in two workers (this machine's two
# cores; a module's tests stay in one worker, which serves its app once)
test: install browser lint
	$(VENV)/bin/pytest -q -n 2 --dist loadfile

test-fast: install lint
	$(VENV)/bin/pytest -q -m "not slow"

bench: install
	$(VENV)/bin/remat bench

# on a machine with a CUDA GPU: predicted against measured peaks, gradients and step times of
# our plans (bench/validate.py); about a minute a model on an H200 (docs/validate.md)
validate-gpu: install
	$(VENV)/bin/remat bench --device cuda --validate

clean:
	rm -rf $(VENV) .pytest_cache
