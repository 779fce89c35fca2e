"""The model runner: SchedulerOutput (pure data) -> flat batch tensors -> forward ->
sampled tokens. It reads only what the SchedulerOutput carries.

Inputs are built with vector ops (numpy) over the whole batch; the only Python
loops are per sequence. A seeded request's random numbers are drawn from a generator
seeded by (its seed, the output position), so its tokens depend on neither the batch
nor how many tokens a step makes (decode bursts, speculative drafts): see
tokenmill/engine/sampler.py. Greedy and plain sampled decodes run several steps in one
native call (decode bursts) that draws as the sampler does.

Speculative drafts (tokenmill/engine/spec): a request's last known token and its k
drafts run as k + 1 single-token decode rows of one step, row j at position start + j
over the same block table (each row writes its K/V before any row attends, and attends
up to its own position). Row j's token is chosen as one-at-a-time decoding would choose
it after the drafts before it (their penalties, their position's random numbers); the
drafts are accepted while they equal those tokens, and the request gets the tokens of
the rows up to the first that differs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import chain

import numpy as np
import torch

from tokenmill.engine.types import TokenLogprob
from tokenmill.engine.sampler import LogitBias, SamplingBatch, TokenMask, as_int64, sample
from tokenmill.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from tokenmill.model.attention import AttentionMetadata, PrefillSeq
from tokenmill.model.fused import FusedDecoder
from tokenmill.model.kernels import native_ops_for


# an all-greedy batch never reads the temperatures; a fresh empty tensor took ~50 us a
# step (right after the native step, with the caches cold)
_NO_TEMPERATURES = torch.zeros(0)


def flat_batch(sch: list[ScheduledRequest]):
    """A step's rows laid end to end: (token ids [T], each row's length and start [S], the
    query offsets [S + 1], each token's row [T] and position [T]), int64 numpy."""
    S = len(sch)
    lens = np.fromiter((len(s.token_ids) for s in sch), dtype=np.int64, count=S)
    starts = np.fromiter((s.start for s in sch), dtype=np.int64, count=S)
    T = int(lens.sum())
    input_ids = np.fromiter(chain.from_iterable(s.token_ids for s in sch), dtype=np.int64, count=T)
    cu = np.zeros(S + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    seq_idx = np.repeat(np.arange(S), lens)
    positions = np.arange(T) - cu[seq_idx] + starts[seq_idx]
    return input_ids, lens, starts, cu, seq_idx, positions


@dataclass
class RunnerOutput:
    # the tokens each request got: one, or several from a burst or accepted drafts
    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)  # one per sampled token
    # request id -> [(position, logprob)] for prompt tokens scored this step
    prompt_logprobs: dict[str, list[tuple[int, TokenLogprob]]] = field(default_factory=dict)
    # embedding requests (params.pooling): request id -> (the chunk's first position, its
    # rows' count, their final hidden states summed in fp32 ("mean"), or the prompt's first
    # row ("cls", from the chunk at 0) or last ("last", from the chunk that ends the prompt))
    pooled: dict[str, tuple[int, int, torch.Tensor]] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model, kv_cache, block_size: int, native_attention: bool = True):
        self.model = model
        self.kernel = native_ops_for(model.cfg.head_dim) if native_attention else None
        self.kv_cache = kv_cache
        # decode steps as one native call where the model allows (None: the model's forward)
        self.fused = FusedDecoder.build(model, kv_cache, self.kernel)
        self.block_size = block_size
        self.vocab_size = model.cfg.vocab_size

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        if not out.scheduled:
            return RunnerOutput()
        if out.num_steps > 1:
            return self._decode_steps(out.scheduled, out.num_steps)
        return self._step(out.scheduled, masks=out)

    def _decode_steps(self, sch: list[ScheduledRequest], steps: int) -> RunnerOutput:
        """`steps` decode steps (greedy or sampled), each step's token the next one's
        input: one native call where the model has it, else step by step (the same tokens
        either way)."""
        inputs = self._inputs(sch)
        temps = torch.tensor([s.params.temperature for s in sch], dtype=torch.float32)
        seeds = torch.tensor([as_int64(s.seed) for s in sch], dtype=torch.int64)
        indices = torch.tensor([len(s.output_token_ids) for s in sch], dtype=torch.int64)
        truncs = (torch.tensor([s.params.top_k for s in sch], dtype=torch.int64),
                  torch.tensor([s.params.top_p for s in sch], dtype=torch.float32),
                  torch.tensor([s.params.min_p for s in sch], dtype=torch.float32))
        toks = self.fused.decode_steps(*inputs[:3], steps, temps, seeds, indices, *truncs) if self.fused else None
        if toks is not None:
            return RunnerOutput(sampled={s.request_id: toks[:, i].tolist() for i, s in enumerate(sch)})
        result = RunnerOutput(sampled={s.request_id: [] for s in sch})
        for _ in range(steps):
            step = self._step(sch, inputs)
            inputs = None
            for s in sch:
                result.sampled[s.request_id] += step.sampled[s.request_id]
            sch = [replace(s, token_ids=step.sampled[s.request_id], start=s.start + 1,
                           output_token_ids=s.output_token_ids + step.sampled[s.request_id]) for s in sch]
        return result

    def _inputs(self, sch: list[ScheduledRequest]):
        """The flat batch: token ids, positions, the attention metadata, query offsets."""
        bs = self.block_size
        S = len(sch)
        input_ids, lens, starts, cu, seq_idx, positions = flat_batch(sch)
        max_blocks = max(len(s.block_ids) for s in sch)
        bt = np.zeros((S, max_blocks), dtype=np.int64)
        for i, s in enumerate(sch):
            bt[i, :len(s.block_ids)] = s.block_ids
        slot_mapping = bt[seq_idx, positions // bs] * bs + positions % bs
        seq_lens = starts + lens

        D = int(np.count_nonzero(lens == 1))
        assert D == 0 or lens[:D].max() == 1, "decodes must come first"
        meta = AttentionMetadata(slot_mapping=torch.from_numpy(slot_mapping), num_decodes=D,
                                 block_tables=torch.from_numpy(bt), seq_lens=torch.from_numpy(seq_lens),
                                 kernel=self.kernel, block_size=bs)
        if any(s.lora_slot >= 0 for s in sch):
            slots = np.fromiter((s.lora_slot for s in sch), dtype=np.int64, count=S)
            meta.lora_slots = torch.from_numpy(np.repeat(slots, lens))
        if D and self.kernel is None:
            Ld = int(seq_lens[:D].max())
            grid = np.arange(Ld)
            dslots = bt[:D, grid // bs] * bs + grid % bs
            meta.decode_slots = torch.from_numpy(dslots)
            meta.decode_mask = torch.from_numpy(grid[None, :] < seq_lens[:D, None]).view(1, D, 1, Ld)
        for i in range(D, S):
            ctx = int(starts[i])
            slots = None
            if ctx:
                grid = np.arange(seq_lens[i])
                slots = torch.from_numpy(bt[i, grid // bs] * bs + grid % bs)
            meta.prefills.append(PrefillSeq(int(cu[i]), int(lens[i]), ctx, slots, seq_index=i))
        return torch.from_numpy(input_ids), torch.from_numpy(positions), meta, cu

    @staticmethod
    def _expand(sch: list[ScheduledRequest]) -> list[ScheduledRequest]:
        """Each request with drafts as its 1 + k decode rows, each seeing the drafts before
        it as output so far (penalties, min_tokens, the seed's position)."""
        rows = []
        for s in sch:
            d = s.draft_token_ids
            if not d:
                rows.append(s)
                continue
            out = s.output_token_ids
            for j, tok in enumerate(s.token_ids):
                rows.append(replace(s, token_ids=[tok], start=s.start + j, num_drafts_before=j,
                                    output_token_ids=out + d[:j] if j else out,
                                    banned_token_ids=s.banned_token_ids if len(out) + j < s.params.min_tokens else []))
        return rows

    def _step(self, sch: list[ScheduledRequest], inputs=None, masks: SchedulerOutput | None = None) -> RunnerOutput:
        """One step; `inputs`: what _inputs(sch) gives, if the caller built it already;
        `masks`: the step's SchedulerOutput, whose grammar masks constrained rows."""
        result = RunnerOutput()
        if any(s.draft_token_ids for s in sch):
            sch = self._expand(sch)
            inputs = None
        ids_t, pos_t, meta, cu = inputs or self._inputs(sch)
        T, D = ids_t.shape[0], meta.num_decodes
        sample_rows = [i for i, s in enumerate(sch) if s.sample and s.params.pooling is None]
        pool_rows = [i for i, s in enumerate(sch) if s.params.pooling is not None]
        wants_prompt = [s.params.prompt_logprobs is not None and s.start < len(s.prompt_token_ids) - 1 for s in sch]
        fused = None
        if D == T and len(sample_rows) == T and not any(wants_prompt):
            fused = self.fused.logits(ids_t, pos_t, meta) if self.fused else None
        if fused is not None:  # one native call from token ids to logits and their argmax
            logits, greedy = fused
        else:
            greedy = None
            hidden = self.fused.hidden(ids_t, pos_t, meta) if self.fused else None
            if hidden is None:
                hidden = self.model.forward(ids_t, pos_t, meta, self.kv_cache)
            if len(sample_rows) == T:  # a decode step that samples every row: no gather
                logits = self.model.logits(hidden)
            elif sample_rows:
                logits = self.model.logits(hidden.index_select(0, torch.from_numpy(cu[1:][sample_rows] - 1)))
        if sample_rows:
            batch = self._sampling_batch([sch[i] for i in sample_rows], masks)
            self._collect(sch, sample_rows, sample(logits, batch, greedy), result)
        for i in pool_rows:
            s = sch[i]
            rows = hidden[cu[i]:cu[i + 1]]
            if s.params.pooling == "mean":
                result.pooled[s.request_id] = (s.start, rows.shape[0], rows.float().sum(0))
            elif s.params.pooling == "cls":
                if s.start == 0:
                    result.pooled[s.request_id] = (0, 1, rows[0].float())
            elif s.sample:
                result.pooled[s.request_id] = (s.start, 1, rows[-1].float())
        for i, s in enumerate(sch):
            if wants_prompt[i]:
                result.prompt_logprobs[s.request_id] = self._prompt_logprobs(s, hidden[cu[i]:cu[i + 1]])
        return result

    @staticmethod
    def _collect(sch: list[ScheduledRequest], sample_rows: list[int], so, result: RunnerOutput) -> None:
        """The sampled rows' tokens (and logprobs) into `result`: a request with drafts gets
        its rows' tokens up to the first that differs from its draft."""
        verified: set[str] = set()  # requests whose run of drafts has ended
        for j, i in enumerate(sample_rows):
            s = sch[i]
            rid = s.request_id
            if rid in verified:
                continue  # a row after a rejected draft: its token is not output
            tok = so.token_ids[j]
            toks = result.sampled.setdefault(rid, [])
            toks.append(tok)
            if s.params.logprobs is not None:
                k = s.params.logprobs
                top = list(zip(so.top_ids[j][:k], so.top_logprobs[j][:k])) if k else []
                result.logprobs.setdefault(rid, []).append(TokenLogprob(tok, so.logprobs[j], top))
            d = s.draft_token_ids
            if not (len(toks) <= len(d) and d[len(toks) - 1] == tok):
                verified.add(rid)

    def _prompt_logprobs(self, s: ScheduledRequest, hidden: torch.Tensor):
        """Score prompt tokens start+1 .. start+len (the ones this chunk's rows predict)."""
        n = min(len(s.token_ids), len(s.prompt_token_ids) - 1 - s.start)
        return self._prompt_logprobs_of(s, self.model.logits(hidden[:n]))

    @staticmethod
    def _prompt_logprobs_of(s: ScheduledRequest, logits: torch.Tensor):
        """The prompt tokens' logprobs from the logits [n, vocab] (host) of the rows predicting them."""
        prompt = s.prompt_token_ids
        n = logits.shape[0]
        logprobs = torch.log_softmax(logits, dim=-1)
        targets = torch.tensor(prompt[s.start + 1:s.start + 1 + n], dtype=torch.int64)
        chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
        k = s.params.prompt_logprobs
        top = torch.topk(logprobs, k, dim=-1) if k else None
        out = []
        for j in range(n):
            tops = list(zip(top.indices[j].tolist(), top.values[j].tolist())) if top is not None else []
            out.append((s.start + 1 + j, TokenLogprob(int(targets[j]), chosen[j], tops)))
        return out

    def _sampling_batch(self, rows: list[ScheduledRequest], masks: SchedulerOutput | None = None) -> SamplingBatch:
        params = [s.params for s in rows]
        all_greedy = all(p.greedy for p in params)
        # (an all-greedy batch never reads the temperatures)
        temps = _NO_TEMPERATURES if all_greedy else torch.tensor([p.temperature for p in params], dtype=torch.float32)
        b = SamplingBatch(temperature=temps, all_greedy=all_greedy)
        if not b.all_greedy:
            if any(p.top_k > 0 for p in params):
                b.top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64)
            if any(p.top_p < 1.0 for p in params):
                b.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
            if any(p.min_p > 0.0 for p in params):
                b.min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)
            b.seeds = [s.seed for s in rows]
            b.indices = [len(s.output_token_ids) for s in rows]
        if any(p.has_penalties for p in params):
            b.presence = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32)
            b.frequency = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32)
            b.repetition = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32)
            b.output_ids = [s.output_token_ids for s in rows]
            b.prompt_ids = [s.prompt_token_ids if s.params.repetition_penalty != 1.0 else [] for s in rows]
        banned = [(j, s.banned_token_ids) for j, s in enumerate(rows) if s.banned_token_ids]
        if banned:
            b.banned = banned
        if any(p.logit_bias for p in params):
            b.logit_bias = LogitBias.from_maps([p.logit_bias for p in params])
        mask = None
        if masks is not None and masks.grammar_rows:  # (a thinking row has no grammar until its answer)
            index = {key: i for i, key in enumerate(masks.grammar_rows)}
            constrained = [j for j, s in enumerate(rows) if (s.request_id, s.num_drafts_before) in index]
            if constrained:
                picked = [index[(rows[j].request_id, rows[j].num_drafts_before)] for j in constrained]
                mask = TokenMask.from_bitmask(constrained, masks.grammar_bitmask[picked], self.vocab_size)
        forced = [j for j, s in enumerate(rows) if s.forced_token_id is not None]
        if forced:
            only = TokenMask.only(forced, [rows[j].forced_token_id for j in forced], self.vocab_size)
            mask = only if mask is None else mask.join(only)
        b.token_mask = mask
        want = [p.logprobs for p in params if p.logprobs is not None]
        if want:
            b.num_logprobs = max(want)
        return b
