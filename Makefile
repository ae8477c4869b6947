# Two commands set up a fresh machine: `make demo` and `make test`.
# Both create .venv when it is missing and install the package into it.

PYTHON ?= python3
VENV := .venv
VENV_PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_DIR ?= /tmp/jaxline_ng_demo

.PHONY: demo test install clean

$(VENV_PY):
	$(PYTHON) -m venv $(VENV)
	$(VENV_PY) -m pip install --quiet --upgrade pip

$(STAMP): setup.py | $(VENV_PY)
	$(VENV_PY) -m pip install --quiet -e '.[examples,test]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(VENV_PY) -m pytest tests

demo: $(STAMP)
	$(VENV_PY) -m jaxline_ng.demo --checkpoint_dir=$(DEMO_DIR)

clean:
	rm -rf $(VENV) .pytest_cache
