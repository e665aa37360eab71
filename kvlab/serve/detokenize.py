"""One sample's text as its tokens arrive: incremental decoding and stop strings.

Decoding each new token alone would break words (a token may hold half a UTF-8
character, and tokenizers drop or add spaces at the edges of what they decode). As vLLM
does, each step decodes a short window twice, with and without the new tokens
(`prefix_offset` .. `read_offset` .. end), and appends the difference; text ending in
an incomplete character ("\\ufffd") waits for the next token.

Stop strings end the sample: the text is cut before the first one found, and while
streaming the last len(longest stop) - 1 characters are held back, since they may be the
start of a stop string.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stop = list(stop or [])
        self.tokens: list[int] = []  # every token consumed (up to the stop string)
        self.text = ""  # decoded so far, cut at a stop string once one is found
        self.sent = 0  # characters of `text` already handed out by `take`
        self.stopped = False  # a stop string was found
        self._prefix_offset = self._read_offset = 0

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def add(self, new_tokens: list[int]) -> None:
        """Consume tokens (ignored once a stop string has been found)."""
        for token in new_tokens:
            if self.stopped:
                return
            self.tokens.append(token)
            self._advance(complete_only=True)

    def _advance(self, complete_only: bool) -> None:
        before = self._decode(self.tokens[self._prefix_offset : self._read_offset])
        after = self._decode(self.tokens[self._prefix_offset :])
        if len(after) > len(before) and not (complete_only and after.endswith("\ufffd")):
            old = len(self.text)
            self.text += after[len(before) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self.tokens)
            self._find_stop(old)

    def _find_stop(self, old_length: int) -> None:
        if not self.stop:
            return
        start = max(0, old_length - max(map(len, self.stop)) + 1)  # a stop may span the edge
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text, self.stopped = self.text[: min(hits)], True

    def take(self, final: bool = False) -> str:
        """The text not handed out yet; unless `final` (or stopped), minus a tail that
        could still become a stop string. `final` also flushes an incomplete character."""
        if final and not self.stopped and self._read_offset < len(self.tokens):
            self._advance(complete_only=False)
        hold = 0 if final or self.stopped or not self.stop else max(map(len, self.stop)) - 1
        end = max(self.sent, len(self.text) - hold)
        out, self.sent = self.text[self.sent : end], end
        return out
