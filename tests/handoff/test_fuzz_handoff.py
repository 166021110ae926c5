"""The network-facing parsers under mutation (docs/reliability.md; the long atheris run is
tests/fuzz/fuzz_handoff.py, its record in docs/benchmarks.md): V3 header and trailer, the
pull request, and both connection cores fed valid streams with bytes flipped, cut,
duplicated and spliced. Every input parses or raises one line of MuserError."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

from muser_cli.handoff.wire import pull_protocol as pull
from muser_cli.handoff.wire.header import HandoffHeader, HandoffTrailer, sign, sign_trailer
from muser_cli.handoff.wire.protocol import Ack, Data, Go, Header, Ready, Trailer, encode_event

_spec = importlib.util.spec_from_file_location("fuzz_handoff", Path(__file__).resolve().parents[1] / "fuzz" / "fuzz_handoff.py")
fz = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fz)  # type: ignore[union-attr]

SECRET = b"k" * 32


def _seeds() -> list[bytes]:
    h = HandoffHeader(key_id="k1", handoff_id="ab" * 16, issued_at_ms=1_796_000_000_000, size_bound=4096,
                      pack_header_digest="cd" * 32, model_fingerprint="sha256:" + "1" * 64,
                      tokenizer_fingerprint="sha256:" + "2" * 64, token_digest="sha256:" + "3" * 64,
                      rows_start=0, sender="gx10")
    raw, mac = sign(h, SECRET)
    t = HandoffTrailer(h.handoff_id, 1000, "ef" * 32)
    traw, tmac = sign_trailer(t, SECRET, mac)
    req = pull.PullRequest(key_id="k1", request_id="12" * 16, issued_at_ms=1_796_000_000_000, consumer="consumer",
                           token_ids=(5, 6, 7), tokenizer_fingerprint="sha256:" + "2" * 64,
                           model_fingerprint="sha256:" + "1" * 64, chunk_tokens=512, dtype="float32")
    rraw, rmac = pull.sign_request(req, SECRET)
    stream = b"".join(encode_event(e) for e in (
        Ready({"v": 3, "node": "consumer"}), Header(raw, mac, h), Go(), Data(b"x" * 300), Trailer(traw, tmac, t),
        Ack({"handoff_id": h.handoff_id})))
    pull_stream = pull.encode(pull.Request(rraw, rmac, req))
    return [b"\0" + raw, b"\1" + traw, b"\2" + rraw, b"\3" + stream, b"\4" + stream, b"\5" + pull_stream,
            b"\3" + stream[::-1], b"\x08" + pull_stream + stream]


def _mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 6)):
        op = rng.randrange(5)
        if op == 0 and len(b) > 1:
            b[rng.randrange(1, len(b))] ^= 1 << rng.randrange(8)
        elif op == 1 and len(b) > 2:
            del b[rng.randrange(1, len(b)):]
        elif op == 2 and len(b) > 2:
            i = rng.randrange(1, len(b))
            b[i:i] = b[i : i + rng.randint(1, 64)]
        elif op == 3:
            b[rng.randrange(1, len(b) + 1):rng.randrange(1, len(b) + 1)] = bytes(rng.randrange(256) for _ in range(8))
        else:
            b[1:1] = rng.choice([b"{", b'"v":', b"\xff", b"NaN", b"[" * 80, b"\0" * 9])
    return bytes(b)


def test_valid_seeds_parse():
    for seed in _seeds():
        fz.one_input(seed)


def test_mutated_inputs_raise_only_one_line_muser_errors():
    rng = random.Random(20261201)
    seeds = _seeds()
    for _ in range(3000):
        fz.one_input(_mutate(rng, rng.choice(seeds)))
