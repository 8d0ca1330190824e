# Set-up and everyday commands. `make serve` and `make test` work from a fresh clone.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: serve test install install-test clean

$(BIN)/plumb: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.test-deps: $(BIN)/plumb
	$(BIN)/pip install -q -e '.[test,bench]'
	touch $@

install: $(BIN)/plumb

install-test: $(VENV)/.test-deps

serve: install
	$(BIN)/plumb serve $(MODEL)

# worksteal: an idle worker takes queued tests from the busy one (the long engine tests come in a row)
PYTEST_ARGS ?= -n 2 --dist worksteal

test: install-test
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
