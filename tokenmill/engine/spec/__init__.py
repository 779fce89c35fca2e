"""Speculative decoding, the scheduler's side: which requests get drafts this step, and
how many. The runner verifies them (tokenmill/engine/runner.py): a request's last token
and its k drafts run as k + 1 decode rows in one step, and each row's token is chosen
exactly as one-at-a-time decoding would choose it there (the same logits, whatever the
other rows; for sampled requests the same random numbers, drawn per output position).
A draft is accepted while it equals that token; the first token that differs, or the
one after the last draft, is the step's last. So outputs do not change with speculation,
greedy or sampled; for a draft that is a single token this is rejection sampling
(accept with probability p(x); on rejection a token from p without x, renormalized).

Per request the acceptance rate is estimated from what its drafts would have done:
drafts run are checked by the model, and drafts proposed but not run (not worth a row)
are compared with the tokens the step then made, for free. See `SpeculativeConfig` for
how that estimate and the step's size set the number of drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.config import SpeculativeConfig
from tokenmill.engine.types import Priority
from tokenmill.engine.request import Request
from tokenmill.engine.spec.proposers import SequenceState, make_proposer

# Acceptance estimate: (accepted + 1) / (accepted + rejected + 2) over evidence that
# decays by this factor at each new observation, so it follows a request whose text
# turns from quoting to writing
_DECAY = 0.9


@dataclass
class SpecStats:
    draft_tokens: int = 0  # drafts run through the model
    accepted_tokens: int = 0  # of those, accepted
    verifications: int = 0  # request-steps that ran drafts

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a request gets from a step that checks its drafts (1 + accepted)."""
        return 1.0 + self.accepted_tokens / self.verifications if self.verifications else 0.0


class _ReqState:
    __slots__ = ("seq", "accepted", "rejected", "shadow")

    def __init__(self, seq: SequenceState):
        self.seq = seq
        self.accepted = 0.0
        self.rejected = 0.0
        self.shadow: list[int] | None = None  # proposed, not run: judged on the next tokens

    @property
    def acceptance(self) -> float:
        return (self.accepted + 1.0) / (self.accepted + self.rejected + 2.0)

    def observe(self, drafts: list[int], tokens: list[int]) -> int:
        m = 0
        while m < len(drafts) and m < len(tokens) and drafts[m] == tokens[m]:
            m += 1
        self.accepted = self.accepted * _DECAY + m
        self.rejected = self.rejected * _DECAY + (1.0 if m < len(drafts) and m < len(tokens) else 0.0)
        return m


class Speculator:
    def __init__(self, cfg: SpeculativeConfig, max_model_len: int):
        self.cfg = cfg
        self.max_model_len = max_model_len
        self.proposer = make_proposer(cfg)
        self.stats = SpecStats()
        self._states: dict[str, _ReqState] = {}

    @staticmethod
    def eligible(req: Request) -> bool:
        sp = req.params
        # batch work is for throughput (its share of steps is metered in tokens)
        return sp.speculative and req.priority == Priority.INTERACTIVE

    def _state(self, req: Request) -> _ReqState:
        st = self._states.get(req.request_id)
        if st is None:
            st = self._states[req.request_id] = _ReqState(self.proposer.new_state())
        return st

    def plan(self, decodes: list[Request], other_tokens: int, room: int) -> dict[str, list[int]]:
        """Drafts for some of this step's decodes (each one token so far): the ones worth
        their rows. other_tokens: the step's prefill tokens (rows too); room: tokens the
        step's budget still has."""
        cfg = self.cfg
        if len(decodes) >= cfg.max_rows or room <= 0:
            return {}
        cands: list[tuple[float, int, str]] = []
        proposals: dict[str, list[int]] = {}
        for req in decodes:
            if not self.eligible(req):
                continue
            k = min(cfg.num_speculative_tokens, req.params.max_tokens - req.num_output_tokens - 1,
                    self.max_model_len - req.num_tokens)
            if k <= 0:
                continue
            st = self._state(req)
            st.seq.sync(req.prompt_token_ids, req.output_token_ids)
            drafts = self.proposer.propose(st.seq, (req.tenant, req.cache_salt), k)
            if not drafts:
                continue
            st.shadow = drafts
            proposals[req.request_id] = drafts
            a = st.acceptance
            cands.extend((a ** (j + 1), j, req.request_id) for j in range(len(drafts)))
        if not cands:
            return {}
        # Take drafts by value (the chance each is accepted; a request's own in order)
        # while one is worth more than its row: value / row_cost above the tokens the
        # step makes per unit of cost so far.
        cands.sort(key=lambda c: (-c[0], c[1]))
        r = cfg.row_cost
        tokens = float(len(decodes))
        taken: dict[str, int] = {}
        decode_rows = len(decodes)
        for value, _, rid in cands:
            if decode_rows >= cfg.max_rows or room <= 0:
                break
            if value * (1.0 + r * (decode_rows + other_tokens - 1)) <= r * tokens:
                break
            taken[rid] = taken.get(rid, 0) + 1
            decode_rows += 1
            room -= 1
            tokens += value
        return {rid: proposals[rid][:n] for rid, n in taken.items()}

    def observe(self, req: Request, drafts: list[int], tokens: list[int]) -> None:
        """The tokens a step gave `req` (before any stop cut them), and the drafts it ran."""
        st = self._states.get(req.request_id)
        if st is None:
            return
        if drafts:
            m = st.observe(drafts, tokens)
            self.stats.draft_tokens += len(drafts)
            self.stats.accepted_tokens += m
            self.stats.verifications += 1
            req.num_draft_tokens += len(drafts)
            req.num_accepted_tokens += m
        elif st.shadow:
            st.observe(st.shadow, tokens)
        st.shadow = None

    def finished(self, req: Request, aborted: bool) -> None:
        st = self._states.pop(req.request_id, None)
        if st is not None and not aborted:
            self.proposer.finished(st.seq, (req.tenant, req.cache_salt), req.output_token_ids)
