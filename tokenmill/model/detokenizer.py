"""Incremental detokenization for streaming.

Byte-level BPE tokens can end in the middle of a UTF-8 character; decoding such a
prefix yields U+FFFD. We decode a short window of recent tokens and emit only text
that is settled: never half a character mid-stream, and on `finish()` whatever is
left, so the concatenated deltas always equal a full decode of all tokens.
"""

from __future__ import annotations

from tokenmill.model.tokenizer import Tokenizer

# Tokens of left context decoded with each new token: enough for merges and
# multi-token characters (a 4-byte character split over 4 tokens).
_WINDOW = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None,
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-_WINDOW:]) if prompt_ids else []
        # ids[prefix:read] is decoded context already emitted; ids[read:] is pending.
        self.prefix = len(self.ids)
        self.read = len(self.ids)
        self.output_text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append a token; return the newly settled text (possibly empty)."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix:self.read])
        full_text = self._decode(self.ids[self.prefix:])
        if full_text.endswith("\ufffd") or len(full_text) <= len(prefix_text):
            return ""  # an incomplete character, or nothing visible yet
        delta = full_text[len(prefix_text):]
        # The tokens just emitted become the left context of the next decode.
        self.prefix, self.read = self.read, len(self.ids)
        self.output_text += delta
        return delta

    def finish(self) -> str:
        """Flush text still held back (an incomplete character at the very end)."""
        if self.read == len(self.ids):
            return ""
        prefix_text = self._decode(self.ids[self.prefix:self.read])
        full_text = self._decode(self.ids[self.prefix:])
        delta = full_text[len(prefix_text):] if full_text.startswith(prefix_text) else full_text
        self.read = len(self.ids)
        self.output_text += delta
        return delta
