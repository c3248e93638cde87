# The two commands of the README: `make run` and `make test`. Both set up .venv on first use.
VENV := .venv
PY := $(VENV)/bin/python
# extra `ultrafast serve` options for `make run`, e.g. SERVE_ARGS="--port 8080 --require-keys"
SERVE_ARGS ?=

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	touch $@

.PHONY: setup run test
setup: $(VENV)/.installed

run: $(VENV)/.installed
	$(VENV)/bin/ultrafast serve $(SERVE_ARGS)

test: $(VENV)/.installed
	$(VENV)/bin/ultrafast pull smollm2-135m qwen2.5-coder-0.5b qwen2.5-coder-1.5b
	$(PY) -m pytest -q
