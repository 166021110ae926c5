"""Text as tokens are decided: :class:`TextStream` turns token ids, one at a time, into the
text they add (nothing while a character is still incomplete), with optional stop strings.

The text is decoded over a short window of recent tokens (the previous piece and the new
ones), not over the whole answer each time, so a long answer costs a constant amount per
token; joined, the pieces are the text of all the ids (``decode_text``), cut at a stop
string when one appears."""

from __future__ import annotations

from typing import Sequence

from muser_cli.model.info import ModelInfo
from muser_cli.model.tokens import decode_text

_INCOMPLETE = "\ufffd"  # what the tokenizer writes for bytes of a character not yet complete


class TextStream:
    def __init__(self, info: ModelInfo, stop: Sequence[str] = ()) -> None:
        self.info = info
        self.ids: list[int] = []
        self.stop = [s for s in stop if s]
        self.stopped = False  # a stop string appeared: nothing more is emitted
        self.matched: str | None = None  # the stop string that appeared (the earliest one)
        self._prefix = 0  # the window: ids[_prefix:_read] is the piece already emitted ...
        self._read = 0  # ... ids[_read:] are not emitted yet
        self._text = ""  # all text decided so far (before any holding back for stop strings)
        self._sent = 0  # characters of _text handed out

    @property
    def text(self) -> str:
        """The text handed out so far."""
        return self._text[: self._sent]

    def push(self, token: int) -> str:
        """The text ``token`` adds (possibly ""), stop strings held back until they cannot match."""
        if self.stopped:
            return ""
        self.ids.append(int(token))
        before = decode_text(self.info, self.ids[self._prefix : self._read])
        now = decode_text(self.info, self.ids[self._prefix :])
        if len(now) > len(before) and not now.endswith(_INCOMPLETE):
            self._text += now[len(before) :]
            self._prefix, self._read = self._read, len(self.ids)
        return self._release(final=False)

    def finish(self) -> str:
        """What is left once no token follows (a held-back tail, an incomplete character)."""
        if not self.stopped and self._read < len(self.ids):
            before = decode_text(self.info, self.ids[self._prefix : self._read])
            now = decode_text(self.info, self.ids[self._prefix :])
            self._text += now[len(before) :]
            self._prefix = self._read = len(self.ids)
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        if self.stopped:
            return ""
        end = len(self._text)
        for s in self.stop:
            at = self._text.find(s, max(0, self._sent - len(s) + 1))
            if at >= 0 and at < end:
                end = at
                self.stopped, self.matched = True, s
        if not self.stopped and not final and self.stop:  # a stop string may still be starting
            hold = max(len(s) for s in self.stop) - 1
            end = max(self._sent, len(self._text) - hold)
        out = self._text[self._sent : end]
        self._sent = end
        return out
