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


def chat_template_text(info: ModelInfo) -> str | None:
    """The text of the model's chat template(s) (None: it has none), for what reads its format."""
    template = getattr(tokenizer_for(info), "chat_template", None)
    if isinstance(template, dict):  # named templates ("default", "tool_use", ...)
        return "\n".join(str(t) for t in template.values()) or None
    return template or None


def render_chat(info: ModelInfo, turns: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None) -> str:
    """The conversation ``turns`` through the model's own chat template, then the assistant
    prompt (``add_generation_prompt=True``). ``tools`` (OpenAI function tools) are given to the
    template; one that writes nothing of them (its text the same with and without) cannot
    offer tools to the model, and is refused rather than silently ignored."""
    tok = tokenizer_for(info)
    if not getattr(tok, "chat_template", None):
        raise ConfigError(f"model {info.name} has no chat template", hint="drop --chat to send the text as is")
    from jinja2 import TemplateError  # transformers' own dependency, as the template is rendered with it

    def render(with_tools: list[dict[str, Any]] | None) -> str:
        try:
            return tok.apply_chat_template(turns, tools=with_tools, add_generation_prompt=True, tokenize=False)
        except (TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
            detail = " ".join(str(exc).split())[:200]
            raise DataError(f"the chat template of {info.name} cannot render this conversation: "
                            f"{type(exc).__name__}: {detail}") from None

    rendered = render(tools or None)
    if tools and rendered == render(None):
        raise ConfigError(f"the chat template of {info.name} does not render tools (its text is the same with and "
                          "without them), so tools cannot be offered to this model")
    return rendered


def encode_prompt(info: ModelInfo, text: str | list[dict[str, Any]], *, chat: bool = False,
                  tools: list[dict[str, Any]] | None = None, prefix: str = "") -> list[int]:
    """Token ids of ``text``; with ``chat`` it becomes one user turn of the chat template
    followed by the assistant prompt (``add_generation_prompt=True``). With ``chat``,
    ``text`` may also be the whole conversation: a list of ``{"role", "content"}`` turns
    (and tool calls and results, as the templates read them), ``tools`` given to the template
    (:func:`render_chat`), and ``prefix``: text the answer is made to start with, written
    after the assistant prompt (a forced opening)."""
    tok = tokenizer_for(info)
    if not chat and not isinstance(text, str):
        raise DataError("a list of chat turns needs the chat template (chat=True)")
    if chat:
        turns = [{"role": "user", "content": text}] if isinstance(text, str) else list(text)
        rendered = render_chat(info, turns, tools=tools) + prefix
        # The template already wrote every special token it wants.
        return list(tok(rendered, add_special_tokens=False)["input_ids"])
    return list(tok(text)["input_ids"])


def skipped_tokens(info: ModelInfo, texts: Sequence[str]) -> dict[int, str]:
    """Of ``texts``, those that are one special token which :func:`decode_text` drops: their id
    and text (so a reader of the answer can see them where decoding hides them)."""
    tok = tokenizer_for(info)
    out: dict[int, str] = {}
    for text in texts:
        if not text:
            continue
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if len(ids) == 1 and not tok.decode(ids, skip_special_tokens=True):
            out[int(ids[0])] = text
    return out


def decode_text(info: ModelInfo, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
    """Text of ``ids`` (special tokens such as EOS dropped unless asked for)."""
    tok = tokenizer_for(info)
    return tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
