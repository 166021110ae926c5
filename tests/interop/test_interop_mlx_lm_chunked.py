"""mlx-lm prompt caches with ``ChunkedKVCache`` layers (Llama 4's chunked attention) in and out
of kvpacks (docs/interop.md), against mlx-lm's own cache objects, ``save_prompt_cache`` and
``load_prompt_cache``:

* a file mlx-lm wrote after its own prefill (of prompt[:-1], or of the whole prompt as
  ``cache_prompt`` writes it) imports as a kvpack 1.4 whose chunked layers carry the rows of
  mlx-lm's own live cache, byte for byte;
* the default gate cannot check the positions before the current chunk (mlx-lm's cache no
  longer holds them): it refuses the pack naming the chunk, ``--prompt`` falls back to the
  local prefill, ``--audit 0`` decodes it to mlx-lm's own continuation;
* exported back, mlx-lm's ``load_prompt_cache`` gives ``ChunkedKVCache`` layers that continue
  with mlx-lm's own tokens.
"""

from __future__ import annotations

import io

import numpy as np
import pytest

from mlx_lm_kit import PROMPT, mx  # first: MLX's BLAS, or the module skipped

from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import ChunkedKVCache, load_prompt_cache, make_prompt_cache, save_prompt_cache  # noqa: E402

from muser_cli.consumer.decode import decode  # noqa: E402
from muser_cli.engines.registry import get_engine  # noqa: E402
from muser_cli.errors import GateIncomplete  # noqa: E402
from muser_cli.interop import mlx_lm as interop  # noqa: E402
from muser_cli.kvpack import read_pack_bytes  # noqa: E402
from muser_cli.model.tokens import encode_prompt  # noqa: E402

pytestmark = pytest.mark.mlx

STEP = 8  # mlx-lm's prefill step: two per chunk of 16
NEW = 12


@pytest.mark.parametrize("whole", [True, False], ids=["cache_prompt", "prompt[:-1]"])
def test_an_mlx_lm_file_with_chunked_layers_imports_decodes_and_exports_back(whole, tiny_family, tmp_path):
    info = tiny_family("llama4_text")
    ids = encode_prompt(info, PROMPT)
    chunk = next(s.chunk for s in info.layers if s.kind == "chunked")
    assert len(ids) > 2 * chunk and (len(ids) - 1) % chunk  # chunks crossed; rows end inside one
    model = get_engine("mlx", info, dtype="float32", threads=1).model
    cache = make_prompt_cache(model)  # mlx-lm's own prefill and file
    for _ in generate_step(mx.array(ids if whole else ids[:-1]), model, max_tokens=0, prompt_cache=cache,
                           prefill_step_size=STEP):
        pass
    assert any(isinstance(c, ChunkedKVCache) for c in cache)
    src = tmp_path / "c.safetensors"
    save_prompt_cache(str(src), cache, {"model": str(info.path), "tokenizer_config": "{}"})

    out = io.BytesIO()
    res = interop.import_mlx_lm(str(src), out, model=str(info.path), prompt=PROMPT, chunk_tokens=STEP)
    assert res.dropped_last_row is whole
    pack = read_pack_bytes(out.getvalue())
    rows = len(ids) - 1
    assert pack.header.minor == 4 and pack.header.rows_end == rows
    for spec, kv, own in zip(info.layers, pack.layers, cache):  # mlx-lm's live cache object, not the file
        if isinstance(own, ChunkedKVCache):
            k, v = own.keys_and_values()
            first = own.start_position
            assert spec.kind == "chunked" and kv.first_row == rows // chunk * chunk
        else:
            k, v, first = own.keys[..., : own.offset, :], own.values[..., : own.offset, :], 0
        a = kv.first_row - first
        assert np.array_equal(np.array(k[0])[:, a: a + kv.keys.shape[1]], kv.keys)
        assert np.array_equal(np.array(v[0])[:, a: a + kv.values.shape[1]], kv.values)

    theirs = [t for t, _ in generate_step(mx.array(ids), model, max_tokens=NEW, prefill_step_size=STEP)]
    with pytest.raises(GateIncomplete, match=f"before the current attention chunk \\({chunk} tokens\\)"):
        decode(io.BytesIO(out.getvalue()), model=str(info.path), engine="mlx", max_new_tokens=NEW)
    local = decode(io.BytesIO(out.getvalue()), model=str(info.path), engine="mlx", max_new_tokens=NEW, prompt=PROMPT)
    unchecked = decode(io.BytesIO(out.getvalue()), model=str(info.path), engine="mlx", max_new_tokens=NEW, audit=0)
    assert local.source == "local" and unchecked.source == "handoff" and unchecked.spot_check["ran"] is False
    assert local.token_ids == unchecked.token_ids == theirs[:NEW] and len(set(theirs)) > 3

    back = tmp_path / "back.safetensors"
    with open(back, "wb") as o:
        interop.export_mlx_lm(io.BytesIO(out.getvalue()), o, model=str(info.path))
    loaded = load_prompt_cache(str(back))
    assert [type(c).__name__ for c in loaded] == [type(c).__name__ for c in cache]
    assert all(c.offset == rows for c in loaded)
    again = [t for t, _ in generate_step(mx.array([ids[-1]]), model, max_tokens=NEW, prompt_cache=loaded)]
    assert again[:NEW] == theirs[:NEW]
