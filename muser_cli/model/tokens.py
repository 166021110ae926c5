"""Text <-> token ids, the same for every engine (one tokenizer per model folder).

The tokenizer is loaded with transformers' AutoTokenizer from the model folder and
kept per (path, tokenizer fingerprint), so a process loads it once.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

from muser_cli.errors import ConfigError, DataError
from muser_cli.model.info import ModelInfo
from muser_cli.model.resolve import quiet_transformers

_TOKENIZERS: dict[tuple[str, str], Any] = {}
_LOCK = threading.Lock()


def tokenizer_for(info: ModelInfo) -> Any:
    """The (cached) transformers tokenizer of ``info``'s folder."""
    key = (str(info.path), info.tokenizer_fingerprint)
    with _LOCK:
        tok = _TOKENIZERS.get(key)
        if tok is None:
            from transformers import AutoTokenizer


            try:
                with quiet_transformers():
                    tok = AutoTokenizer.from_pretrained(str(info.path))
            except (OSError, ValueError) as exc:
                raise DataError(f"cannot load the tokenizer of {info.path}: {exc}") from exc
            _TOKENIZERS[key] = tok
        return tok


def encode_prompt(info: ModelInfo, text: str | list[dict[str, str]], *, chat: bool = False) -> list[int]:
    """Token ids of ``text``; with ``chat`` it becomes one user turn of the chat template
    followed by the assistant prompt (``add_generation_prompt=True``). With ``chat``,
    ``text`` may also be the whole conversation: a list of ``{"role", "content"}`` turns."""
    tok = tokenizer_for(info)
    if not chat and not isinstance(text, str):
        raise DataError("a list of chat turns needs the chat template (chat=True)")
    if chat:
        if not getattr(tok, "chat_template", None):
            raise ConfigError(f"model {info.name} has no chat template", hint="drop --chat to send the text as is")
        turns = [{"role": "user", "content": text}] if isinstance(text, str) else list(text)
        rendered = tok.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
        # The template already wrote every special token it wants.
        return list(tok(rendered, add_special_tokens=False)["input_ids"])
    return list(tok(text)["input_ids"])


def decode_text(info: ModelInfo, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
    """Text of ``ids`` (special tokens such as EOS dropped unless asked for)."""
    tok = tokenizer_for(info)
    return tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
