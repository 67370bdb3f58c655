"""Incremental detokenization with stop strings, for streaming.

`TextStream.add(token)` returns the text that can be shown now. It never returns a broken UTF-8
character (a byte-level token can end inside one: the decoded tail is then U+FFFD, held until
the next token completes it), and never returns text that a stop string may still claim: the
longest tail that is a prefix of some stop string is held back until it is decided. When a stop
string appears, the text ends just before it. `finish()` ends the stream: the final text is the
tokenizer's decode of every id (so a character cut by the token limit shows as U+FFFD, as TGI
gives it), and whatever was held back is released. What is not here: sampling, the stop on EOS.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop: tuple[str, ...] = (), *, skip_special_tokens: bool = True,
                 include_stop: bool = False):  # fmt: skip
        self.tok = tokenizer
        self.skip_special, self.include_stop = skip_special_tokens, include_stop
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.prefix_offset = 0  # ids[:prefix_offset] are already in self.text
        self.read_offset = 0
        self.text = ""  # all complete text so far
        self.emitted = 0  # characters of self.text handed out
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip_special)

    def add(self, token_id: int) -> str:
        """Append one token; the newly showable text (possibly empty)."""
        self.ids.append(token_id)
        # Decode a short window starting at a character boundary, not the whole sequence.
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.ids[self.prefix_offset :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._release()

    def _release(self) -> str:
        for s in self.stop:
            at = self.text.find(s, max(0, self.emitted - len(s)))
            if at != -1:
                self.text = self.text[: at + (len(s) if self.include_stop else 0)]
                self.stopped = True
                return self.flush()
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        end = max(self.emitted, len(self.text) - hold)
        out, self.emitted = self.text[self.emitted : end], end
        return out

    def finish(self) -> str:
        """The request has ended: everything not yet handed out."""
        if not self.stopped:
            full = self._decode(self.ids)
            if full.startswith(self.text):  # a byte-level decode extends its own prefix
                self.text = full
        return self.flush()

    def flush(self) -> str:
        """Everything not yet handed out."""
        out, self.emitted = self.text[self.emitted :], len(self.text)
        return out
