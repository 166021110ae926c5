"""A kvpack described for a person or a script: what `verify` and `pack --info` print."""

from __future__ import annotations

from muser_cli.kvpack.format import PackHeader
from muser_cli.kvpack.reader import KVPack


def summarize(pack: KVPack) -> dict:
    return summarize_header(pack.header, total_bytes=pack.total_bytes, stored_bytes=pack.stored_bytes,
                            root_digest=pack.root_digest)


def summarize_header(h: PackHeader, *, total_bytes: int, stored_bytes: int, root_digest: bytes) -> dict:
    """The same description from a header and what the reader counted (a streamed pack)."""
    kinds: dict[str, int] = {}
    bytes_by_kind: dict[str, int] = {}
    for i, spec in enumerate(h.layers):
        kinds[spec.kind] = kinds.get(spec.kind, 0) + 1
        bytes_by_kind[spec.kind] = bytes_by_kind.get(spec.kind, 0) + h.layer_logical_bytes(i)  # state: one snapshot
    raw = h.total_logical_bytes()  # in the header dtype, before codec and quantization
    return {
        "model": h.model_name, "model_fingerprint": h.model_fingerprint,
        "tokenizer_fingerprint": h.tokenizer_fingerprint, "tokens": len(h.token_ids),
        "token_digest": h.token_digest, "rows": [h.rows_start, h.rows_end], "dtype": h.dtype,
        "chunk_tokens": h.chunk_tokens, "layers": kinds, "kv_bytes_by_kind": bytes_by_kind,
        "kv_bytes": raw, "pack_bytes": total_bytes, "codec": h.codec.get("name"),
        "ratio": round(raw / stored_bytes, 4) if stored_bytes else None,
        "producer": h.producer, "root_digest": root_digest.hex(),
        "version": f"{h.raw.get('version', [1, 0])[0]}.{h.minor}",
        **({"ring_extra": h.ring_extra} if h.ring_extra else {}),  # v1.2: sliding rows beyond window - 1
    }
