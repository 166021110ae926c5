"""A GGUF file's metadata, read from its header without loading anything, and the chat template
of a model folder.

A GGUF (llama.cpp's format, version 2 or 3) starts with ``GGUF``, its version (uint32), its
tensor count and key-value count (uint64 each), then the key-value pairs: a key (uint64 length +
UTF-8), a value type (uint32) and the value; everything little-endian. :func:`gguf_string`
walks those pairs, skipping each value by its size, until it finds the key asked for. The chat
template a GGUF carries is ``tokenizer.chat_template`` (a Jinja string, as Hugging Face
tokenizers keep it).

A model folder's chat template is wherever transformers reads one: ``chat_template`` in
``tokenizer_config.json``, ``chat_template.jinja``, ``chat_template.json`` or the
``additional_chat_templates/`` folder (:func:`has_chat_template`, no transformers import).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import BinaryIO

from muser_cli.errors import DataError

CHAT_TEMPLATE_KEY = "tokenizer.chat_template"
#: value type -> struct format of the fixed-size scalars
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_KEYS = 1 << 20  # far past any real file's count: a bigger one is a damaged header
_MAX_NESTING = 4


class _Header:
    """Reads the header's fields in order, refusing to read past the file's end."""

    def __init__(self, fh: BinaryIO, size: int, file: Path) -> None:
        self.fh, self.size, self.file = fh, size, file

    def bytes(self, n: int) -> bytes:
        if n < 0 or self.fh.tell() + n > self.size:
            raise DataError(f"{self.file}: not a readable GGUF file (its header runs past the file's end)")
        return self.fh.read(n)

    def skip(self, n: int) -> None:
        if n < 0 or self.fh.tell() + n > self.size:
            raise DataError(f"{self.file}: not a readable GGUF file (its header runs past the file's end)")
        self.fh.seek(n, 1)

    def number(self, fmt: str) -> int | float | bool:
        return struct.unpack(fmt, self.bytes(struct.calcsize(fmt)))[0]

    def string(self) -> bytes:
        return self.bytes(int(self.number("<Q")))

    def skip_value(self, kind: int, depth: int = 0) -> None:
        if kind in _SCALARS:
            self.skip(struct.calcsize(_SCALARS[kind]))
        elif kind == _STRING:
            self.skip(int(self.number("<Q")))
        elif kind == _ARRAY and depth < _MAX_NESTING:
            item, count = int(self.number("<I")), int(self.number("<Q"))
            if item in _SCALARS:
                self.skip(count * struct.calcsize(_SCALARS[item]))
            else:
                for _ in range(count):
                    self.skip_value(item, depth + 1)
        else:
            raise DataError(f"{self.file}: not a readable GGUF file (value type {kind} in its header)")


def gguf_string(file: Path, key: str) -> str | None:
    """The string value of metadata ``key`` in the GGUF ``file`` (None: the file has no such key).
    A file that is not a GGUF of version 2 or 3, or whose header is cut or damaged, is a
    :class:`DataError`; so is ``key`` holding something other than a string."""
    file = Path(file)
    try:
        size = file.stat().st_size
        with open(file, "rb", buffering=1 << 20) as fh:
            header = _Header(fh, size, file)
            if header.bytes(4) != b"GGUF":
                raise DataError(f"{file}: not a GGUF file (no GGUF magic)")
            version = header.number("<I")
            if version not in (2, 3):
                raise DataError(f"{file}: GGUF version {version} is not read here (2 and 3 are)")
            header.number("<Q")  # tensor count
            count = int(header.number("<Q"))
            if count > _MAX_KEYS:
                raise DataError(f"{file}: not a readable GGUF file ({count} metadata keys)")
            wanted = key.encode()
            for _ in range(count):
                name = header.string()
                kind = int(header.number("<I"))
                if name != wanted:
                    header.skip_value(kind)
                    continue
                if kind != _STRING:
                    raise DataError(f"{file}: its metadata {key} is not a string (value type {kind})")
                try:
                    return header.string().decode("utf-8")
                except UnicodeDecodeError:
                    raise DataError(f"{file}: its metadata {key} is not UTF-8 text") from None
    except OSError as exc:
        raise DataError(f"cannot read {file}: {exc}") from exc
    return None


def gguf_chat_template(file: Path) -> str | None:
    """The chat template the GGUF ``file`` carries (``tokenizer.chat_template``), None if none
    (an empty one counts as none)."""
    return gguf_string(file, CHAT_TEMPLATE_KEY) or None


def has_chat_template(folder: Path) -> bool:
    """Whether the model folder has a chat template where transformers reads one."""
    folder = Path(folder)
    jinja = folder / "chat_template.jinja"
    if jinja.is_file() and jinja.stat().st_size > 0:
        return True
    templates = folder / "additional_chat_templates"
    if templates.is_dir() and any(templates.glob("*.jinja")):
        return True
    for name in ("chat_template.json", "tokenizer_config.json"):
        try:
            value = json.loads((folder / name).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            continue
        if isinstance(value, dict) and value.get("chat_template"):
            return True
    return False


__all__ = ["CHAT_TEMPLATE_KEY", "gguf_chat_template", "gguf_string", "has_chat_template"]
