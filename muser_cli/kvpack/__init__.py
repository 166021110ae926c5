"""kvpack: the KV interchange format (pure Python + numpy; no ML framework).

Specified in docs/kvpack.md.
"""

from muser_cli.errors import KVPackError
from muser_cli.kvpack.format import MAJOR, MINOR, PackHeader, token_digest
from muser_cli.kvpack.layers import DTYPES, LayerKV, LayerSpec, RopeSpec
from muser_cli.kvpack.reader import EndEvent, FrameEvent, HeaderEvent, KVPack, PackReader, read_pack, read_pack_bytes
from muser_cli.kvpack.writer import PackWriter, write_pack

__all__ = [
    "DTYPES", "EndEvent", "FrameEvent", "HeaderEvent", "KVPack", "KVPackError", "LayerKV", "LayerSpec",
    "MAJOR", "MINOR", "PackHeader", "PackReader", "PackWriter", "RopeSpec", "read_pack", "read_pack_bytes",
    "token_digest", "write_pack",
]
