"""Thinking budgets: where each thinking request's reply stands (before, inside or after
its `<think>` block, in token ids), how many reasoning tokens it has made (tags
included), and, once a budget is spent, the closing tag's tokens it must output next so
the answer can still come. Pure Python; the scheduler calls it:

- `observe` with each committed token (`update`), `replay` when a stop string cut the
  output back;
- `forced` for a row that samples: the one token its mask allows (the runner masks the
  rest through the sampler's TokenMask), or None;
- `in_answer`: a grammar (structured output, tool calls) applies only after the block;
- `room`: how many tokens a burst or a run of speculative drafts may make before the
  budget needs a forced token (None: no bound).

The reply opens the block when its first tokens are the opening tag (or the prompt
opened it, or the model always thinks: deepseek_r1); a reply that starts otherwise has
no block. Once the first token of a multi-token opening tag is out, the rest of the tag
is forced, so a grammar never sees half a tag."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.engine.request import Request

START, THINK, ANSWER = "start", "think", "answer"


@dataclass
class _State:
    phase: str
    count: int = 0  # reasoning tokens so far, tags included
    closing: int = 0  # of the closing tag: tokens forced so far


class ThinkingBudgets:
    def __init__(self) -> None:
        self._states: dict[str, _State] = {}

    def _state(self, req: Request) -> _State | None:
        tags = req.params.thinking
        if tags is None:
            return None
        st = self._states.get(req.request_id)
        if st is None:
            st = self._states[req.request_id] = _State(THINK if (tags.inside or tags.always) else START)
        return st

    def observe(self, req: Request, tok: int) -> bool:
        """`tok` was just appended to req's output; True: it is part of the answer (not of
        a thinking block)."""
        st = self._state(req)
        if st is None:
            return True
        return self._advance(req, st, len(req.output_token_ids))

    def _advance(self, req: Request, st: _State, n: int) -> bool:
        """The output's n-th token (its first n are out) moves the reply through its phases."""
        if st.phase == ANSWER:
            return True
        tags = req.params.thinking
        out = req.output_token_ids
        if st.phase == START:
            if n <= len(tags.open_ids) and tuple(out[:n]) == tags.open_ids[:n]:
                st.count = n
                if n == len(tags.open_ids):
                    st.phase = THINK
            else:  # no block: the answer began (a half-written opening tag is answer too)
                st.phase, st.count = ANSWER, 0
            req.num_reasoning_tokens = st.count
            return st.phase == ANSWER
        st.count += 1
        if st.closing:
            st.closing += 1
        k = len(tags.close_ids)
        if n >= k and tuple(out[n - k:n]) == tags.close_ids:
            st.phase, st.closing = ANSWER, 0
        req.num_reasoning_tokens = st.count
        return False

    def replay(self, req: Request) -> None:
        """The output changed other than by appending (a stop string cut it): count again
        from the start over the output as it now is."""
        if self._states.pop(req.request_id, None) is None:
            return
        req.num_reasoning_tokens = 0
        st = self._state(req)
        for n in range(1, len(req.output_token_ids) + 1):
            self._advance(req, st, n)

    def _budget_left(self, req: Request, st: _State) -> int | None:
        """Tokens it may still think freely before the closing tag must begin."""
        budget = req.params.thinking_token_budget
        if budget is None:
            return None
        return budget - len(req.params.thinking.close_ids) - st.count

    def forced(self, req: Request) -> int | None:
        """The token req must output next, if one is forced."""
        st = self._state(req)
        if st is None or st.phase == ANSWER:
            return None
        tags = req.params.thinking
        if st.phase == START:
            n = req.num_output_tokens
            return tags.open_ids[n] if 0 < n < len(tags.open_ids) else None
        if st.closing == 0:
            left = self._budget_left(req, st)
            if left is None or left > 0:
                return None
            st.closing = 1  # (counted from here as the forced tokens are observed)
        return tags.close_ids[st.closing - 1]

    def in_answer(self, req: Request) -> bool:
        """Its next token belongs to the answer (a grammar constrains it)."""
        st = self._state(req)
        return st is None or st.phase == ANSWER

    def in_start(self, req: Request) -> bool:
        """Whether the reply opens a block is still undecided (its next token may open it)."""
        st = self._state(req)
        return st is not None and st.phase == START

    def room(self, req: Request) -> int | None:
        """The most tokens req may make in one step (a burst, or drafts and one more)
        without passing a point where a token must be forced: None for no bound, 1 while
        a token is forced or the block may still open."""
        st = self._state(req)
        if st is None or st.phase == ANSWER:
            return None
        if st.phase == START or st.closing:
            return 1
        left = self._budget_left(req, st)
        return None if left is None else max(1, left)

    def free(self, request_id: str) -> None:
        self._states.pop(request_id, None)
