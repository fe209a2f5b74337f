# `make run`, `make test` and `make lint` each set up what they need (a virtual environment in .venv with
# the CPU build of torch 2.13.0 and this package, editable) and then do their job. Every package is
# installed at the version constraints.txt names (the versions the suite was last green with);
# `make constraints` refreshes that file from a new environment resolved without it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test lint constraints clean

$(STAMP): pyproject.toml Makefile constraints.txt
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11) and "make needs Python 3.11+ (constraints.txt pins numpy, \
	scipy, pandas and onnxruntime releases that require it), found " + sys.version.split()[0] + ": make PYTHON=python3.11")'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0 triton==3.6.0
	$(PY) -m pip install -q -c constraints.txt -e ".[test,onnx,serve]"
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m metrale_graph.tools.prefill

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup

# ruff over the repository, its rules in pyproject.toml ([tool.ruff])
lint: $(STAMP)
	$(PY) -m ruff check .

# Resolve the newest versions pyproject.toml allows in a scratch environment and write them to constraints.txt.
constraints:
	rm -rf .venv-constraints
	$(PYTHON) -m venv .venv-constraints
	.venv-constraints/bin/python -m pip install -q --upgrade pip
	.venv-constraints/bin/python -m pip install -q torch==2.13.0 triton==3.6.0
	.venv-constraints/bin/python -m pip install -q -e ".[test,onnx,serve]"
	{ sed -n '1,2p' constraints.txt; .venv-constraints/bin/python -m pip freeze --exclude-editable \
	  | sed 's/^torch==\([0-9.]*\)+cpu$$/torch==\1/'; } > constraints.txt.new
	mv constraints.txt.new constraints.txt
	rm -rf .venv-constraints

clean:
	rm -rf $(VENV) *.egg-info
