"""Where the n-grams of a growing token list occur: the lookup both proposers share.

An n-gram (n in [n_min, n_max]) is keyed by its tuple's hash and maps to the end
positions of its latest `keep` occurrences; a hit is verified against the tokens, so a
hash collision costs a comparison, never a wrong answer. Indexing is incremental: each
new token adds the n-grams that end at it, so a step's lookup costs a few dictionary
probes, not a scan of the context. Pure Python (the scheduler's side of the engine).
"""

from __future__ import annotations

SEPARATOR = -1  # between sequences of a corpus: no continuation runs across it


class NgramIndex:
    def __init__(self, n_min: int, n_max: int, keep: int = 16):
        self.n_min = n_min
        self.n_max = n_max
        self.keep = keep
        self.tokens: list[int] = []
        self._ends: dict[int, list[int]] = {}
        self._indexed = 0  # the n-grams ending before this position are in _ends

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens) -> None:
        self.tokens.extend(tokens)

    def index_upto(self, upto: int) -> None:
        """Index the n-grams that end at positions [indexed, upto)."""
        t, ends, keep = self.tokens, self._ends, self.keep
        for e in range(self._indexed, min(upto, len(t))):
            if t[e] == SEPARATOR:
                continue
            for n in range(self.n_min, min(self.n_max, e + 1) + 1):
                key = hash(tuple(t[e + 1 - n:e + 1]))
                lst = ends.get(key)
                if lst is None:
                    ends[key] = [e]
                else:
                    lst.append(e)
                    if len(lst) > keep:
                        del lst[0]
        self._indexed = max(self._indexed, upto)

    def occurrences(self, pattern: list[int]) -> list[int]:
        """End positions of `pattern`'s indexed occurrences, latest first."""
        lst = self._ends.get(hash(tuple(pattern)))
        if not lst:
            return []
        n, t = len(pattern), self.tokens
        return [e for e in reversed(lst) if t[e + 1 - n:e + 1] == pattern]

    def clear(self) -> None:
        self.tokens = []
        self._ends = {}
        self._indexed = 0
