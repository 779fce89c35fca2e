"""Engine outputs: token ids -> text deltas, stop strings, logprobs, per request.

Stop strings are matched on text, across token boundaries. While a request could
still be in the middle of a stop string, the last (longest stop - 1) characters are
held back, so a stop string never leaks into a stream and is not in the output.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.engine.request import Request
from tokenmill.engine.types import RequestOutput, TokenLogprob
from tokenmill.engine.runner import RunnerOutput
from tokenmill.model.detokenizer import IncrementalDetokenizer
from tokenmill.model.tokenizer import Tokenizer


class _TextState:
    def __init__(self, req: Request, tokenizer: Tokenizer | None):
        sp = req.params
        self.detok = (IncrementalDetokenizer(tokenizer, req.prompt_token_ids, sp.skip_special_tokens)
                      if tokenizer is not None else None)
        self.stops = sp.stop
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            [None] if sp.prompt_logprobs is not None else None)
        self.prompt_logprobs_sent = False
        self.stopped = False  # a stop string ended the text: nothing after it is emitted
        self.stop_reason: str | None = None  # the stop string found
        self.num_sent = 0  # output tokens already passed on (a step may add several)
        self.pooled = None  # an embedding request's pooled hidden state so far (a tensor)
        self.num_pooled = 0  # the prompt rows in it


@dataclass(frozen=True)
class StopEvent:
    """A stop string ends `request`'s output after its first `num_output_tokens` tokens."""
    request: Request
    num_output_tokens: int
    reason: str


class OutputProcessor:
    """Token ids -> text deltas and outputs. It reads request state and never writes it:
    the stops it finds go to the scheduler as events."""

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self._states: dict[str, _TextState] = {}

    def add(self, req: Request) -> None:
        self._states[req.request_id] = _TextState(req, self.tokenizer)

    def find_stops(self, produced: list[Request]) -> list[StopEvent]:
        """Detokenize the tokens each request made this step and find the stop strings in
        its text. The events say where each request's output ends; the scheduler, which
        owns request state, applies them (before `emit`)."""
        events: list[StopEvent] = []
        for req in produced:
            st = self._states[req.request_id]
            for j, tok in enumerate(req.output_token_ids[st.num_sent:]):
                if st.detok is not None:
                    st.pending += st.detok.add(tok)
                if st.stops and self._stop_hit(req, st):
                    events.append(StopEvent(req, st.num_sent + j + 1, st.stop_reason))
                    break
        return events

    def emit(self, produced: list[Request], result: RunnerOutput) -> list[RequestOutput]:
        """Outputs for the requests that produced tokens this step (after their stops were
        applied): text released where it can no longer be part of a stop string."""
        outputs: list[RequestOutput] = []
        for rid, entries in result.prompt_logprobs.items():
            st = self._states.get(rid)
            if st is None or st.prompt_logprobs is None:
                continue
            for pos, lp in entries:  # a recompute after preemption scores positions again
                if pos == len(st.prompt_logprobs):
                    st.prompt_logprobs.append(lp)
        for rid, (start, count, vec) in result.pooled.items():
            st = self._states.get(rid)
            if st is None:
                continue
            if start == 0 or st.pooled is None:  # the first chunk (again, after a preemption)
                st.pooled, st.num_pooled = vec, count
            else:
                st.pooled, st.num_pooled = st.pooled + vec, st.num_pooled + count
        for req in produced:
            st = self._states[req.request_id]
            toks = req.output_token_ids[st.num_sent:]
            st.num_sent += len(toks)
            text = self._flush(st) if req.finished else self._release(st)
            lp = result.logprobs.get(req.request_id)
            logprobs = lp[:len(toks)] if lp is not None and toks else None
            outputs.append(self._output(req, st, toks, text, logprobs))
        return outputs

    def finished_output(self, req: Request) -> RequestOutput | None:
        """The last output of a request ended outside `process` (an abort)."""
        st = self._states.get(req.request_id)
        if st is None:
            return None
        return self._output(req, st, [], self._flush(st), None)

    def drop(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    # -- text ---------------------------------------------------------------------------
    def _stop_hit(self, req: Request, st: _TextState) -> bool:
        if req.num_output_tokens < req.params.min_tokens:
            return False
        best = None
        for s in st.stops:
            i = st.pending.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        end = i + len(s) if req.params.include_stop_str_in_output else i
        st.pending = st.pending[:end]
        st.stopped = True
        st.stop_reason = s
        return True

    @staticmethod
    def _release(st: _TextState) -> str:
        """Text that can no longer be part of a stop string."""
        cut = len(st.pending) - st.hold
        if cut <= 0:
            return ""
        text, st.pending = st.pending[:cut], st.pending[cut:]
        return text

    @staticmethod
    def _flush(st: _TextState) -> str:
        if st.detok is not None and not st.stopped:
            st.pending += st.detok.finish()
        text, st.pending = st.pending, ""
        return text

    def _output(self, req: Request, st: _TextState, toks: list[int], text: str,
                logprobs: list[TokenLogprob] | None) -> RequestOutput:
        finished = req.finished
        plp = None
        if st.prompt_logprobs is not None and not st.prompt_logprobs_sent:
            plp = st.prompt_logprobs
            st.prompt_logprobs_sent = True
        embedding = None
        if finished:
            self._states.pop(req.request_id, None)
            if st.pooled is not None and req.finish_reason != "abort":
                pooled = st.pooled / st.num_pooled if req.params.pooling == "mean" else st.pooled
                embedding = pooled.tolist()
        return RequestOutput(
            request_id=req.group_id, index=req.index, new_token_ids=toks, text=text,
            finished=finished, finish_reason=req.finish_reason, stop_reason=req.stop_reason,
            num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=req.num_cached_tokens,
            cache_write_tokens=req.cache_write_tokens,
            num_output_tokens=req.num_output_tokens, logprobs=logprobs, prompt_logprobs=plp,
            times=req.times if finished else None,
            num_draft_tokens=req.num_draft_tokens, num_accepted_tokens=req.num_accepted_tokens,
            num_reasoning_tokens=req.num_reasoning_tokens, embedding=embedding,
        )
