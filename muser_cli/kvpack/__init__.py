"""kvpack: the KV interchange format (pure Python + numpy; no ML framework).

Specified in docs/kvpack.md.
"""

from muser_cli.errors import KVPackError
from muser_cli.kvpack.format import MAJOR, MINOR, PackHeader, token_digest
from muser_cli.kvpack.layers import DTYPES, LayerKV, LayerSpec, RopeSpec, StateKV, latent_spec, state_spec
from muser_cli.kvpack.digest import DEFAULT_DIGEST, DIGESTS
from muser_cli.kvpack.reader import (
    EndEvent, FrameEvent, HeaderEvent, KVPack, PackReader, buffer_events, read_buffer, read_pack, read_pack_bytes,
)
from muser_cli.kvpack.writer import PackWriter, write_pack

__all__ = [
    "DEFAULT_DIGEST", "DIGESTS", "DTYPES", "EndEvent", "FrameEvent", "HeaderEvent", "KVPack", "KVPackError", "LayerKV", "LayerSpec",
    "MAJOR", "MINOR", "PackHeader", "PackReader", "PackWriter", "RopeSpec", "StateKV", "buffer_events", "latent_spec", "state_spec", "read_buffer", "read_pack", "read_pack_bytes",
    "token_digest", "write_pack",
]
