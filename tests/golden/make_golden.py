"""Write the kvpack v1.0 golden files (run once per format version; never regenerate v1 files).

    python tests/golden/make_golden.py
One file per layer class x codec (and int8), plus MANIFEST.json with their sha256.
"""

from __future__ import annotations

import hashlib
import io
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from golden_rows import CASES, golden_header, golden_rows  # noqa: E402

from muser_cli.kvpack import write_pack  # noqa: E402
from muser_cli.pack import pack  # noqa: E402


def main() -> None:
    manifest = {}
    for layer_class in CASES:
        header = golden_header(layer_class)
        rows = golden_rows(header)
        for codec in ("none", "zstd", "zstd+bytegroup"):
            buf = io.BytesIO()
            write_pack(buf, header, rows, codec=codec)
            name = f"v1_0-{layer_class}-{codec.replace('+', '_')}.kvpack"
            (HERE / name).write_bytes(buf.getvalue())
            manifest[name] = hashlib.sha256(buf.getvalue()).hexdigest()
        src = io.BytesIO()
        write_pack(src, header, rows)
        src.seek(0)
        out = io.BytesIO()
        pack(src, out, codec="zstd+bytegroup", quant="int8")
        name = f"v1_0-{layer_class}-int8.kvpack"
        (HERE / name).write_bytes(out.getvalue())
        manifest[name] = hashlib.sha256(out.getvalue()).hexdigest()
    (HERE / "MANIFEST.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
