"""Draft proposers: guesses of a request's next tokens taken from text, not a model.

- `NgramProposer` (prompt lookup): the longest n-gram (n from prompt_lookup_max down to
  prompt_lookup_min) that ends the request's tokens and occurred earlier in its prompt
  or output; the draft is what followed its latest occurrence. Pays where the answer
  quotes its input: summaries that quote, edits of a given file, answers from a document.
- `SuffixProposer` (suffix decoding, arXiv 2411.04975): the same match over the request's
  own tokens and over the recent outputs of requests with the same isolation key (tenant
  and cache salt, as the prefix cache: text never crosses tenants), continued by
  frequency: at each place the most frequent next token among all the occurrences still
  in the run, while the product of those frequencies stays above `suffix_min_prob`. An
  index of hashed n-grams over the occurrences answers the queries a depth-bounded
  suffix tree answers (all occurrences of the pattern, the counts of what follows). Pays
  on repetitive agent and code traffic, where one request's output repeats another's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from tokenmill.config import SpeculativeConfig
from tokenmill.engine.spec.index import SEPARATOR, NgramIndex


class SequenceState:
    """One request's tokens (prompt and output so far) and their index."""

    def __init__(self, n_min: int, n_max: int):
        self.index = NgramIndex(n_min, n_max)

    def ready(self) -> list[int]:
        """The tokens, with the n-grams that end before the last one indexed (where an
        earlier occurrence of the request's ending can be)."""
        t = self.index.tokens
        self.index.index_upto(len(t) - 1)
        return t

    def sync(self, prompt: list[int], output: list[int]) -> None:
        """Bring the copy up to the request's tokens (they only grow while it runs)."""
        idx = self.index
        have = len(idx.tokens)
        if have == 0:
            idx.extend(prompt)
            have = len(prompt)
        n_out = have - len(prompt)
        if n_out < len(output):
            idx.extend(output[n_out:])


class NgramProposer:
    def __init__(self, cfg: SpeculativeConfig):
        self.n_min = cfg.prompt_lookup_min
        self.n_max = cfg.prompt_lookup_max

    def new_state(self) -> SequenceState:
        return SequenceState(self.n_min, self.n_max)

    def propose(self, state: SequenceState, key: Hashable, k: int) -> list[int]:
        t = state.ready()
        L = len(t)
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            ends = state.index.occurrences(t[L - n:])
            if ends:
                e = ends[0]
                return t[e + 1:e + 1 + k]
        return []

    def finished(self, state: SequenceState, key: Hashable, output: list[int]) -> None:
        pass


class SuffixProposer:
    def __init__(self, cfg: SpeculativeConfig):
        self.n_min = cfg.prompt_lookup_min
        self.n_max = cfg.suffix_max_match
        self.min_prob = cfg.suffix_min_prob
        self.max_tokens = cfg.suffix_max_tokens
        self.max_corpora = cfg.suffix_max_tenants
        self._corpora: OrderedDict[Hashable, NgramIndex] = OrderedDict()

    def new_state(self) -> SequenceState:
        return SequenceState(self.n_min, self.n_max)

    def propose(self, state: SequenceState, key: Hashable, k: int) -> list[int]:
        own = state.index
        t = state.ready()
        L = len(t)
        corpus = self._corpora.get(key)
        for n in range(min(self.n_max, L), self.n_min - 1, -1):
            pattern = t[L - n:]
            runs = [(t, e) for e in own.occurrences(pattern)]
            if corpus is not None:
                runs += [(corpus.tokens, e) for e in corpus.occurrences(pattern)]
            if runs:
                break
        else:
            return []
        drafts: list[int] = []
        score = 1.0
        while len(drafts) < k:
            at = len(drafts) + 1
            counts: dict[int, int] = {}
            for toks, e in runs:  # latest first: a tie goes to the latest occurrence
                if e + at < len(toks) and toks[e + at] != SEPARATOR:
                    counts[toks[e + at]] = counts.get(toks[e + at], 0) + 1
            if not counts:
                break
            tok, c = max(counts.items(), key=lambda x: x[1])
            score *= c / len(runs)
            if score < self.min_prob:
                break
            drafts.append(tok)
            runs = [(toks, e) for toks, e in runs if e + at < len(toks) and toks[e + at] == tok]
        return drafts

    def finished(self, state: SequenceState, key: Hashable, output: list[int]) -> None:
        """Add a finished request's output to its tenant's corpus (the newest kept)."""
        if not output:
            return
        corpus = self._corpora.pop(key, None)
        if corpus is None:
            corpus = NgramIndex(self.n_min, self.n_max)
            while len(self._corpora) >= self.max_corpora:
                self._corpora.popitem(last=False)
        self._corpora[key] = corpus  # the most recently used last
        corpus.extend(output[-self.max_tokens:])
        corpus.extend([SEPARATOR])
        if len(corpus) > self.max_tokens:
            # keep the newest three quarters; the index is rebuilt over them (amortized:
            # a quarter of the capacity arrives between rebuilds)
            keep = corpus.tokens[len(corpus) - self.max_tokens * 3 // 4:]
            corpus.clear()
            corpus.extend(keep)
        corpus.index_upto(len(corpus))

    def corpus_tokens(self, key: Hashable) -> int:
        c = self._corpora.get(key)
        return len(c) if c is not None else 0


def make_proposer(cfg: SpeculativeConfig):
    return SuffixProposer(cfg) if cfg.method == "suffix" else NgramProposer(cfg)
