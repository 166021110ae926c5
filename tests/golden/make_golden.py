"""Write the kvpack golden files of one format version (run once per version; never
regenerate the files of an earlier one: they pin what every later reader must read).

    python tests/golden/make_golden.py 1.1     # writes the v1_1-* files and MANIFEST-v1_1.json
    python tests/golden/make_golden.py 1.2     # writes the v1_2-* files and MANIFEST-v1_2.json
    python tests/golden/make_golden.py 1.3     # writes the v1_3-* files and MANIFEST-v1_3.json
    python tests/golden/make_golden.py 1.4     # writes the v1_4-* files and MANIFEST-v1_4.json
The v1.0 files (v1_0-*, MANIFEST.json) were written by this script's v1.0 form on
2026-11-29 and are never rewritten. One file per layer class x codec (and int8); v1.1
adds the sha256 digest for the uncompressed files (blake3 is its default). v1.2 differs
from v1.1 only for sliding layers (``ring_extra``): its files are the sliding class with
``ring_extra`` 1 (window rows, not window - 1). v1.3 adds the layer kinds: its files are
the latent class (two MLA layers) and the hybrid class (a state layer, then a full one).
v1.4 adds the chunked kind: its files are the chunked class (a chunked layer of chunk 5,
then a full NoPE one) with ``ring_extra`` 1, as muser's producers write it (21 tokens: the
chunked layer carries positions [15, 20), the ring row reaching into the previous chunk).
"""

from __future__ import annotations

import hashlib
import io
import json
import sys
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from golden_rows import CASES, CASES_V1_3, CASES_V1_4, golden_header, golden_rows  # noqa: E402

from muser_cli.kvpack import write_pack  # noqa: E402
from muser_cli.produce.pack import pack  # noqa: E402

VARIANTS = {
    "1.1": [(codec, "blake3") for codec in ("none", "zstd", "zstd+bytegroup", "int8")] + [("none", "sha256")],
    "1.2": [(codec, "blake3") for codec in ("none", "zstd+bytegroup", "int8")] + [("none", "sha256")],
    "1.3": [(codec, "blake3") for codec in ("none", "zstd+bytegroup", "int8")] + [("none", "sha256")],
    "1.4": [(codec, "blake3") for codec in ("none", "zstd+bytegroup", "int8")] + [("none", "sha256")],
}
CLASSES = {"1.1": CASES, "1.2": ("sliding-rope",), "1.3": CASES_V1_3, "1.4": CASES_V1_4}
RING_EXTRA = {"1.1": 0, "1.2": 1, "1.3": 0, "1.4": 1}


def main(version: str) -> None:
    if version not in VARIANTS:
        raise SystemExit(f"only {', '.join(VARIANTS)} can be written; earlier golden files are never regenerated")
    minor = int(version.split(".")[1])
    tag = "v" + version.replace(".", "_")
    manifest_path = HERE / f"MANIFEST-{tag}.json"
    if manifest_path.exists():
        raise SystemExit(f"{manifest_path.name} exists: golden files are written once")
    manifest = {}
    for layer_class in CLASSES[version]:
        for codec, digest in VARIANTS[version]:
            header = replace(golden_header(layer_class), minor=minor, digest=digest, ring_extra=RING_EXTRA[version])
            rows = golden_rows(header)
            buf = io.BytesIO()
            if codec == "int8":
                src = io.BytesIO()
                write_pack(src, header, rows)
                src.seek(0)
                pack(src, buf, codec="zstd+bytegroup", quant="int8")
            else:
                write_pack(buf, header, rows, codec=codec)
            name = f"{tag}-{layer_class}-{codec.replace('+', '_')}-{digest}.kvpack"
            (HERE / name).write_bytes(buf.getvalue())
            manifest[name] = hashlib.sha256(buf.getvalue()).hexdigest()
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "")
