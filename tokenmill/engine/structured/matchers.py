"""Per-request grammar matchers and the batch bitmask.

`GrammarMatchers` is the engine's one owner of matcher state. The engine adds a
matcher when it queues a constrained sequence; the scheduler advances it with each
token it commits (`accept`, its `TokenConstraints` hook) and frees it when the
sequence ends however it ends (`free`); the runner asks for the bitmask of the rows
it samples (`fill_bitmask`). A preempted sequence keeps its output tokens, so its
matcher, which has consumed exactly those, stays valid across the recompute.

Compiled grammars are cached by spec (an LRU of template matchers; a request gets
a cheap deep copy), so a schema sent again costs no compile.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np

from tokenmill.engine.types import InvalidParameter, StructuredOutput
from tokenmill.engine.structured.grammar import PARAM, grammar_of, spec_key

log = logging.getLogger("tokenmill.engine.structured")


class GrammarMatchers:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], cache_size: int = 256):
        """tokenizer: the model's `Tokenizer` (its HF `tokenizers` object is what llguidance
        reads); None for a model without one, which then refuses constrained requests."""
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.words = (vocab_size + 31) // 32  # int32 words per bitmask row
        self._lltok = None  # built on first use (~0.5 s)
        self._compiled: OrderedDict[str, object] = OrderedDict()
        self._cache_size = cache_size
        self._matchers: dict[str, object] = {}
        self._bitmask = np.zeros((0, self.words), dtype=np.int32)
        self.compiles = 0  # grammars compiled (cache misses)

    # -- lifecycle ----------------------------------------------------------------------
    def _ll_tokenizer(self):
        if self._lltok is None:
            import llguidance as llg

            if self._tokenizer is None:
                raise InvalidParameter(PARAM, f"{PARAM}: output constraints need the model's tokenizer, "
                                              "and this model has none")
            self._lltok = llg.LLTokenizer(self._tokenizer.hf.to_str(), n_vocab=self.vocab_size,
                                          eos_token=list(self.eos_token_ids))
        return self._lltok

    def compile(self, spec: StructuredOutput):
        """The template matcher of a spec, compiled once and cached."""
        import llguidance as llg

        key = spec_key(spec)
        m = self._compiled.get(key)
        if m is not None:
            self._compiled.move_to_end(key)
            return m
        m = llg.LLMatcher(self._ll_tokenizer(), grammar_of(spec), log_level=0)
        if m.is_error():
            raise InvalidParameter(PARAM, f"{PARAM} is not a valid output constraint: {m.get_error()}")
        self.compiles += 1
        self._compiled[key] = m
        if len(self._compiled) > self._cache_size:
            self._compiled.popitem(last=False)
        return m

    def add(self, request_id: str, spec: StructuredOutput) -> None:
        """A fresh matcher for one sequence. Raises InvalidParameter for a bad spec."""
        self._matchers[request_id] = self.compile(spec).deep_copy()

    def free(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    # -- the step -----------------------------------------------------------------------
    def accept(self, request_id: str, token: int) -> bool:
        """Advance a sequence's matcher by a committed token. True when the constraint
        is complete (nothing but EOS may follow): the sequence should stop here."""
        m = self._matchers.get(request_id)
        if m is None:
            return False
        if not m.consume_token(token):
            # the mask forbade this token, so this is our bug; end the sequence rather
            # than let it run on unconstrained
            log.error("request %s: token %d rejected by its grammar: %s", request_id, token, m.get_error())
            return True
        return m.is_stopped()

    def fill_bitmask(self, request_ids: list[str], ahead: list[list[int]] | None = None,
                     also: list[int | None] | None = None) -> np.ndarray:
        """[len(request_ids), words] int32 bitmask of the tokens each sequence may take
        next (bit t % 32 of word t // 32). A view of a buffer reused by the next call.
        ahead: per row, speculative drafts the row comes after: its mask is the one after
        them (the matcher advances over them and is rolled back). A row after a draft the
        grammar forbids gets every token: the draft is rejected (its own row's mask
        forbids it), so that row's token is never output. also: per row, a token allowed
        beside the grammar's (None: none), e.g. a thinking block's opening tag."""
        n = len(request_ids)
        if self._bitmask.shape[0] < n:
            self._bitmask = np.zeros((max(n, 2 * self._bitmask.shape[0]), self.words), dtype=np.int32)
        out = self._bitmask[:n]
        row_bytes = self.words * 4
        for i, rid in enumerate(request_ids):
            m = self._matchers[rid]
            before = ahead[i] if ahead is not None else None
            if not before:
                m.unsafe_compute_mask_ptr(out[i].ctypes.data, row_bytes)
                continue
            ok = m.try_consume_tokens(before)
            if ok == len(before) and not m.is_stopped():
                m.unsafe_compute_mask_ptr(out[i].ctypes.data, row_bytes)
            else:
                out[i] = -1
            if ok:
                m.rollback(ok)
        for i, tok in enumerate(also or ()):
            if tok is not None:
                out[i].view(np.uint32)[tok // 32] |= np.uint32(1 << (tok % 32))
        return out
