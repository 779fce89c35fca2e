"""The engine core of an encoder model (tokenmill/model/bert.py): embedding requests
only. It has LLMEngine's face (add_resolved, abort, step, stats, limits), so the
threaded and process fronts run it unchanged, and the server's limits, gate and
pricing see it as any engine.

A step takes waiting requests in class order (interactive first, then arrival) while
the step's token budget (max_num_batched_tokens; one input always fits) and the
sequence slots (max_num_seqs) last, runs them as one flat batch and finishes them all:
an encoder has no KV cache, so nothing is carried from one step to the next.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import time
from dataclasses import dataclass

import torch

from tokenmill.config import EngineConfig, default_num_threads
from tokenmill.engine.api import RequestLimits, check_knobs
from tokenmill.engine.types import (EngineStats, InvalidParameter, Priority, RequestOutput, RequestTimes,
                                    ResolvedParams)
from tokenmill.model.bert import BertEncoder

log = logging.getLogger("tokenmill.engine")


@dataclass
class _Waiting:
    request_id: str
    ids: list[int]
    priority: int
    times: RequestTimes
    deadline: float | None


class EncoderEngine:
    def __init__(self, model: BertEncoder, tokenizer, config: EngineConfig | None = None):
        config = config or EngineConfig()
        torch.set_num_threads(config.num_threads or default_num_threads())
        self.model = model
        self.tokenizer = tokenizer
        self.model_config = model.cfg
        self.config = config
        cfg = model.cfg
        max_len = min(config.max_model_len or cfg.max_seq_length, cfg.max_seq_length)
        sched = config.scheduler
        # no KV cache: a step holds at most its slots' worth of the longest input
        self.limits = RequestLimits(max_len, max_len * sched.max_num_seqs, cfg.vocab_size, config.bounds)
        self._sched = sched
        self._heap: list[tuple[int, int, str]] = []  # (priority, arrival order, id)
        self._waiting: dict[str, _Waiting] = {}
        self._order = itertools.count()
        self.prompt_tokens_computed = 0
        self.steps = 0

    def add_resolved(self, request_id: str, prompt_token_ids: list[int], params: ResolvedParams,
                     *, priority: int = Priority.INTERACTIVE, cache_salt: str | None = None,
                     tenant: str | None = None, arrival_time: float | None = None,
                     deadline: float | None = None, lora: str | None = None) -> None:
        if lora is not None:
            raise InvalidParameter("model", f"no LoRA adapter named {lora!r} (an encoder has none)")
        if params.pooling is None:
            raise InvalidParameter("model", f"{self.model_config.name} is an embedding model: it generates no text")
        if request_id in self._waiting:
            raise InvalidParameter("request_id", f"duplicate request id {request_id!r}")
        self.limits.check_token_ids(prompt_token_ids)
        times = RequestTimes(arrival=arrival_time if arrival_time is not None else time.monotonic())
        self._waiting[request_id] = _Waiting(request_id, list(prompt_token_ids), int(priority), times, deadline)
        heapq.heappush(self._heap, (int(priority), next(self._order), request_id))

    def abort(self, request_id: str, reason: str | None = None) -> list[RequestOutput]:
        w = self._waiting.pop(request_id, None)
        return [] if w is None else [self._output(w, None, reason)]

    def tune(self, knobs: dict[str, int]) -> None:
        knobs = check_knobs(knobs)
        knobs.pop("decode_steps", None)  # nothing decodes here
        self._sched = dataclasses.replace(self._sched, **knobs)

    def has_unfinished(self) -> bool:
        return bool(self._waiting)

    def close(self) -> None:
        pass

    def _output(self, w: _Waiting, vec: list[float] | None, reason: str | None = None) -> RequestOutput:
        w.times.finished = time.monotonic()
        return RequestOutput(request_id=w.request_id, index=0, new_token_ids=[], text="", finished=True,
                             finish_reason="stop" if vec is not None else "abort", stop_reason=reason,
                             num_prompt_tokens=len(w.ids), num_cached_tokens=0, num_output_tokens=0,
                             times=w.times, embedding=vec)

    def step(self) -> list[RequestOutput]:
        now = time.monotonic()
        outputs = [self._output(w, None, "deadline") for w in list(self._waiting.values())
                   if w.deadline is not None and w.deadline <= now]
        for o in outputs:
            del self._waiting[o.request_id]
        batch: list[_Waiting] = []
        tokens = 0
        while self._heap and len(batch) < self._sched.max_num_seqs:
            w = self._waiting.get(self._heap[0][2])
            if w is None:  # aborted or expired
                heapq.heappop(self._heap)
                continue
            if batch and tokens + len(w.ids) > self._sched.max_num_batched_tokens:
                break
            heapq.heappop(self._heap)
            batch.append(w)
            tokens += len(w.ids)
        if not batch:
            return outputs
        for w in batch:
            w.times.first_scheduled = now
        vecs = self.model.embed([w.ids for w in batch])
        done = time.monotonic()
        self.steps += 1
        self.prompt_tokens_computed += tokens
        for w, vec in zip(batch, vecs.tolist()):
            del self._waiting[w.request_id]
            w.times.first_token = done
            outputs.append(self._output(w, vec))
        return outputs

    def stats(self) -> EngineStats:
        oldest = min((w.times.arrival for w in self._waiting.values() if w.priority == Priority.INTERACTIVE),
                     default=None)
        batch = sum(1 for w in self._waiting.values() if w.priority == Priority.BATCH)
        return EngineStats(num_waiting=len(self._waiting), num_waiting_interactive=len(self._waiting) - batch,
                           num_waiting_batch=batch,
                           oldest_waiting_s=0.0 if oldest is None else time.monotonic() - oldest,
                           prompt_tokens_computed=self.prompt_tokens_computed, steps=self.steps)


def build_core(config: EngineConfig, defaults=None):
    """The engine core a model needs: an EncoderEngine for an encoder folder, else the
    LLMEngine (torch and the weights load here, in the engine's thread or process)."""
    from tokenmill.model.encoder_config import is_encoder_folder

    m = config.model
    if is_encoder_folder(m.path):
        from tokenmill.model.bert import load_encoder
        from tokenmill.model.encoder_config import read_encoder_tokenizer

        return EncoderEngine(load_encoder(m.path), read_encoder_tokenizer(m.path), config)
    from tokenmill.engine.device import resolve
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.model.loader import load_model

    config = resolve(config)  # (the torch runner loads dense weights)
    m = config.model
    return LLMEngine(load_model(m.path, m.dtype, m.quantization, m.activation_levels), config, defaults)
