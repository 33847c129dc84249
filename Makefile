# Everything a fresh machine needs, in one place. `make demo` and `make test` set up .venv first.
PYTHON ?= python3
VENV   ?= .venv
# An extra package index, e.g. https://download.pytorch.org/whl/cpu for torch's CPU build
PIP_INDEX ?=
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup demo test lint bench screenshots clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]' torch==2.13.0 $(if $(PIP_INDEX),--extra-index-url $(PIP_INDEX))
	touch $(STAMP)

demo: setup
	@# q then y stops the demo with 130, a user's stop: not a failure of make's
	$(VENV)/bin/ranktop --nproc-per-node 4 examples/demo_train.py || [ $$? -eq 130 ]

test: setup
	@# Compiled as an install would be: with PYTHONDONTWRITEBYTECODE=1 every ranktop a test starts
	@# would otherwise compile its modules again (about 0.3 s of CPU each time).
	$(PY) -m compileall -q ranktop core tui >/dev/null
	@# Four workers (pytest-xdist), a test file to each in turn: most of a test's time is spent
	@# waiting on its ranks, so even on 2 cores four at once beat three (298-316 s against 349-353 s).
	$(PY) -m pytest -q -n 4 --dist loadfile

lint: setup
	$(VENV)/bin/ruff check .

bench: setup
	$(PY) bench/bench_launch.py
	$(PY) bench/bench_stacks.py

screenshots: setup
	$(PY) -m pip install --quiet -e '.[screenshots]'
	$(PY) scripts/screenshots.py
	$(PY) -m pip install --quiet -e '.[web]'
	$(PY) scripts/web_screenshot.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
