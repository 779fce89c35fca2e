"""Engine outputs: token ids -> text deltas, stop strings, logprobs, per request.

Stop strings are matched on text, across token boundaries. While a request could
still be in the middle of a stop string, the last (longest stop - 1) characters are
held back, so a stop string never leaks into a stream and is not in the output.
"""

from __future__ import annotations

from collections.abc import Callable

from tokenmill.engine.types import RequestOutput, TokenLogprob
from tokenmill.engine.request import Request, RequestStatus
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
        self.num_sent = 0  # output tokens already passed on (a step may add several)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self._states: dict[str, _TextState] = {}

    def add(self, req: Request) -> None:
        self._states[req.request_id] = _TextState(req, self.tokenizer)

    def process(self, produced: list[Request], result: RunnerOutput,
                on_stop: Callable[[Request], None]) -> list[RequestOutput]:
        """Outputs for the requests that produced a token this step. A request whose text
        now contains a stop string is ended through `on_stop` before its output is built."""
        outputs: list[RequestOutput] = []
        for rid, entries in result.prompt_logprobs.items():
            st = self._states.get(rid)
            if st is None or st.prompt_logprobs is None:
                continue
            for pos, lp in entries:  # a recompute after preemption scores positions again
                if pos == len(st.prompt_logprobs):
                    st.prompt_logprobs.append(lp)
        for req in produced:
            st = self._states[req.request_id]
            toks = req.output_token_ids[st.num_sent:]
            for j, tok in enumerate(toks):
                if st.detok is not None:
                    st.pending += st.detok.add(tok)
                if st.stops and self._stop_hit(req, st):
                    # tokens a burst of steps made after the stop string are not output
                    del req.output_token_ids[st.num_sent + j + 1:]
                    del req.times.tokens[st.num_sent + j + 1:]
                    del toks[j + 1:]
                    if req.finished:  # the scheduler ended it on a later token (length, EOS)
                        req.status = RequestStatus.FINISHED_STOPPED
                    else:
                        on_stop(req)
                    break
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
        req.stop_reason = s
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
        if finished:
            self._states.pop(req.request_id, None)
        return RequestOutput(
            request_id=req.group_id, index=req.index, new_token_ids=toks, text=text,
            finished=finished, finish_reason=req.finish_reason, stop_reason=req.stop_reason,
            num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=req.num_cached_tokens,
            cache_write_tokens=req.cache_write_tokens,
            num_output_tokens=req.num_output_tokens, logprobs=logprobs, prompt_logprobs=plp,
            times=req.times if finished else None,
            num_draft_tokens=req.num_draft_tokens, num_accepted_tokens=req.num_accepted_tokens,
        )
