# Two commands set up a fresh machine: `make demo` and `make test`.
# Both create .venv when it is missing and install the package into it.

PYTHON ?= python3
VENV := .venv
VENV_PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_DIR ?= /tmp/jaxline_ng_demo

.PHONY: demo test lint platforms install clean

$(VENV_PY):
	$(PYTHON) -m venv $(VENV)
	$(VENV_PY) -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml setup.py | $(VENV_PY)
	$(VENV_PY) -m pip install --quiet -e '.[examples,test]'
	touch $(STAMP)

install: $(STAMP)

# One pytest worker per core: most tests wait on processes they launched.
test: $(STAMP)
	$(VENV_PY) -m pytest -n auto --dist worksteal --durations=10 tests

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# Do the dependencies resolve to wheels on Linux x86_64/aarch64 and macOS arm64?
platforms: $(STAMP)
	$(VENV_PY) tests/check_platforms.py

# The digits example, trained and evaluated side by side; then where to look.
demo: $(STAMP)
	rm -rf $(DEMO_DIR)
	XLA_FLAGS=--xla_force_host_platform_device_count=4 \
	    $(VENV_PY) examples/digits/experiment.py --config=examples/digits/experiment.py \
	    --jaxline_mode=train_eval_multithreaded --config.checkpointer=disk \
	    --config.checkpoint_dir=$(DEMO_DIR)
	$(VENV_PY) -m jaxline_ng.summary $(DEMO_DIR)

clean:
	rm -rf $(VENV) .pytest_cache
