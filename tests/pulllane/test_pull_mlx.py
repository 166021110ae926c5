"""``prefill --serve --engine mlx`` (issue 12): a resident MLX producer (mlx[cpu] here) answers
pull requests; its rows are MLX's own local prefill's, byte for byte, and a follow-up that
shares whole chunks is continued from the last request's rows. Real processes, mutual TLS on
127.0.0.1, the tiny Llama."""

from __future__ import annotations

import importlib.util
import json
import subprocess

import numpy as np
import pytest

from handoff_kit import HANG_S, env_for, lane_flags, make_nodes, muser_cmd, serving

# Not imported here: MLX picks its BLAS when it first loads (muser_cli.engines.mlx.blas), in the
# processes that run it.
pytestmark = [pytest.mark.mlx, pytest.mark.skipif(importlib.util.find_spec("mlx_lm") is None,
                                                  reason="mlx-lm not installed")]

DOC = ("The committee met on a grey Tuesday to decide where the new bridge would go. After a long debate "
       "about costs, traffic and the river's spring floods, they chose the northern site.")
CHUNK = 8


def layers_of(path):
    from muser_cli.kvpack import read_pack

    with open(path, "rb") as f:
        pack = read_pack(f)
    return pack, [(np.asarray(layer.keys), np.asarray(layer.values), layer.first_row) for layer in pack.layers]


def test_an_mlx_producer_serves_its_local_prefills_rows(tmp_path, tiny_llama):
    nodes = make_nodes(tmp_path)
    model = str(tiny_llama.path)
    common = lane_flags(model)
    env = env_for(nodes.consumer_home)
    doc, follow = tmp_path / "doc.txt", tmp_path / "follow.txt"
    doc.write_text(DOC)
    follow.write_text(DOC + " Why the northern site and not the southern one?")
    local = {}
    for name, prompt in (("doc", doc), ("follow", follow)):
        out = tmp_path / f"local-{name}.kvpack"
        r = subprocess.run(muser_cmd("prefill", *common, "--engine", "mlx", "--chunk", str(CHUNK), "-o", str(out),
                                     str(prompt)), env=env, capture_output=True, timeout=HANG_S)
        assert r.returncode == 0, r.stderr
        local[name] = out
    with serving(nodes.producer_home, *common, "--engine", "mlx") as producer:
        for name, prompt in (("doc", doc), ("follow", follow)):
            out = tmp_path / f"pulled-{name}.kvpack"
            r = subprocess.run(muser_cmd("receive", "--from", producer.address, str(prompt), "-m", model,
                                         "--chunk", str(CHUNK), "--dtype", "float32", "--no-reuse", "-o", str(out)),
                               env=env, capture_output=True, timeout=HANG_S)
            assert r.returncode == 0, r.stderr
            pulled, got = layers_of(out)
            want_pack, want = layers_of(local[name])
            assert pulled.header.token_ids == want_pack.header.token_ids
            assert pulled.header.producer.get("engine") == "mlx", pulled.header.producer
            assert len(got) == len(want) and all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]
                                                  for a, b in zip(got, want)), name
        served = producer.wait_events(2)
        assert [e["outcome"] for e in served] == ["served", "served"], served
        assert served[0]["reused_rows"] == 0 and served[1]["reused_rows"] > 0  # the follow-up continued the doc's
        dec = subprocess.run(muser_cmd("decode", *common, "--engine", "mlx", "--chunk", str(CHUNK), "--prompt",
                                       str(doc), "-n", "6", "--no-reuse", "--json", "--producer", producer.address),
                             env=env, capture_output=True, timeout=HANG_S)
        assert dec.returncode == 0, dec.stderr
        loc = subprocess.run(muser_cmd("decode", *common, "--engine", "mlx", "--chunk", str(CHUNK), "--prompt",
                                       str(doc), "-n", "6", "--no-reuse", "--json"), input=b"",
                             env=env, capture_output=True, timeout=HANG_S)
        assert loc.returncode == 0, loc.stderr
        got, want = json.loads(dec.stdout), json.loads(loc.stdout)
        assert got["source"] == "handoff" and not got["fallback"] and got["token_ids"] == want["token_ids"], got
