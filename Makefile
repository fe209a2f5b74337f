# `make run` and `make test` each set up what they need (a virtual environment in .venv with
# the CPU build of torch 2.13.0 and this package, editable) and then do their job.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 triton==3.6.0
	$(PY) -m pip install -q -e ".[test,onnx,serve]"
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m metrale_graph.tools.prefill

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup

clean:
	rm -rf $(VENV) *.egg-info
