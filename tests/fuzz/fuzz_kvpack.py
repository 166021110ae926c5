"""Coverage-guided fuzzing of the kvpack reader (atheris).

Contract: any input either parses into a verified pack or raises KVPackError; no other
exception, no hang. Run (not part of the pytest suite; docs/kvpack.md states the count):

    python tests/fuzz/fuzz_kvpack.py -atheris_runs=1000000 -timeout=1 [-max_len=4096]
"""

from __future__ import annotations

import io
import os
import sys

import atheris

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import json  # noqa: E402,F401  (imported first: only muser's own code is instrumented)

import numpy  # noqa: E402,F401
import zstandard  # noqa: E402,F401

with atheris.instrument_imports(include=["muser_cli"]):
    from muser_cli.errors import KVPackError
    from muser_cli.kvpack import PackReader, read_pack_bytes

from kvpack_factory import llama_layers, make_pack  # noqa: E402

SEEDS = [make_pack(5, layers=llama_layers(1), chunk=2, codec=c)[0] for c in ("none", "zstd", "zstd+bytegroup")]
SEEDS.append(make_pack(11, chunk=4)[0])


def one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    mode = fdp.ConsumeIntInRange(0, 3)
    if mode == 0:
        blob = fdp.ConsumeBytes(len(data))
    else:
        # mutate a valid pack: structured mutations reach deeper than random bytes
        seed = bytearray(SEEDS[mode % len(SEEDS)])
        for _ in range(fdp.ConsumeIntInRange(1, 4)):
            if not seed:
                break
            pos = fdp.ConsumeIntInRange(0, len(seed) - 1)
            op = fdp.ConsumeIntInRange(0, 2)
            if op == 0:
                seed[pos] ^= 1 << fdp.ConsumeIntInRange(0, 7)
            elif op == 1:
                del seed[pos:]
            else:
                seed[pos:pos] = fdp.ConsumeBytes(fdp.ConsumeIntInRange(1, 8))
        blob = bytes(seed)
    try:
        read_pack_bytes(blob)
    except KVPackError:
        pass
    # the sans-IO reader in odd-sized pieces must agree
    reader = PackReader()
    try:
        step = 1 + (len(blob) % 257)
        for i in range(0, len(blob), step):
            reader.feed(blob[i : i + step])
        reader.finish()
    except KVPackError:
        pass


def main() -> None:
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
