# `make train` and `make test` bootstrap .venv from nothing with Python 3.12.
SHELL := /bin/bash
VENV := .venv
STAMP := $(VENV)/.installed
PYTEST_FLAGS ?= -n 2 -q

# The first Python 3.12 that really runs: python3.12 on PATH, else pyenv's 3.12.
PYTHON312 := $(shell \
  for c in python3.12 $$(ls -d $$HOME/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | sort -V | tail -1) \
           "env PYENV_VERSION=$$(pyenv versions --bare 2>/dev/null | grep '^3\.12' | tail -1) pyenv exec python3.12"; do \
    if $$c -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then echo "$$c"; break; fi; \
  done)

.PHONY: train test test-slow test-all clean-venv

$(STAMP): setup.py
	@if [ -z '$(PYTHON312)' ]; then \
	  echo "error: Python 3.12 not found (tried python3.12 and pyenv's 3.12). Install it, e.g. 'pyenv install 3.12'." >&2; \
	  exit 1; fi
	@echo "Creating $(VENV) with: $(PYTHON312)"
	rm -rf $(VENV)
	$(PYTHON312) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[test]'
	touch $(STAMP)

train: $(STAMP)
	$(VENV)/bin/python -m experiments.train --gin_file=configs/tiny.gin --workdir=runs/tiny

test: $(STAMP)
	JAX_PLATFORMS=cpu $(VENV)/bin/python -m pytest -m "not slow" $(PYTEST_FLAGS) tests

test-slow: $(STAMP)
	JAX_PLATFORMS=cpu $(VENV)/bin/python -m pytest -m slow $(PYTEST_FLAGS) tests

test-all: $(STAMP)
	JAX_PLATFORMS=cpu $(VENV)/bin/python -m pytest $(PYTEST_FLAGS) tests

clean-venv:
	rm -rf $(VENV)
