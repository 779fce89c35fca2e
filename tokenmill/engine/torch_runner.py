"""The torch runner: the model runner on any torch device, CUDA or the CPU (issue 46).

The same contract as ModelRunner (SchedulerOutput in, RunnerOutput out; the scheduler
and KV manager untouched); the model computes with PyTorch ops only
(tokenmill/model/torch_paged.py) on the device that holds its weights and KV cache.
Per step the host sends the flat batch's small metadata (token ids, positions, slots,
block tables: one copy each) and gets back the sampled token ids. Decode-only steps run
through CUDA-graph buckets on a GPU (tokenmill/engine/decode_graphs.py).

Sampling: an all-greedy step with nothing that changes the logits (no grammar mask,
bias, penalty, banned token) and no logprobs takes its argmax on the device; any other
step copies its sampled rows' logits to the host and samples there with the engine's
sampler (tokenmill/engine/sampler.py), so seeds, truncation, masks and logprobs mean what
they mean on the CPU path.
"""

from __future__ import annotations


import numpy as np
import torch

from tokenmill.engine.decode_graphs import DecodeGraphs, cuda_capture, eager_capture
from tokenmill.engine.runner import ModelRunner, RunnerOutput, flat_batch
from tokenmill.engine.sampler import SamplerOutput, sample
from tokenmill.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from tokenmill.model.torch_paged import PrefillChunk, TorchBatch, TorchKVCache, forward


class TorchRunner(ModelRunner):
    def __init__(self, model, kv_cache: TorchKVCache, block_size: int, device: torch.device,
                 max_rows: int = 0, max_blocks: int = 0, cuda_graphs: bool | None = None):
        """`max_rows`, `max_blocks`: the largest decode step and block table the CUDA-graph
        buckets cover (0: no graphs); `cuda_graphs`: capture them (None: on a CUDA device)
        or False: run the buckets eagerly (the CPU tests)."""
        self.model = model
        self.kernel = None
        self.fused = None
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.vocab_size = model.cfg.vocab_size
        self.device = device
        self.graphs = None
        if max_rows and max_blocks:
            capture = cuda_graphs if cuda_graphs is not None else device.type == "cuda"
            self.graphs = DecodeGraphs(self._decode_logits, max_rows, max_blocks, kv_cache.scratch_block, device,
                                       cuda_capture if capture else eager_capture)
            self.graphs.block_size = block_size

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        with torch.inference_mode():
            return super().execute(out)

    def _decode_logits(self, input_ids, positions, slots, tables, lens) -> torch.Tensor:
        b = TorchBatch(input_ids, positions, slots, tables, lens, block_size=self.block_size)
        return self.model.logits(forward(self.model, b, self.kv_cache))

    def _inputs(self, sch: list[ScheduledRequest]):
        """The step's TorchBatch on the device, and the query offsets [S + 1] (host)."""
        bs = self.block_size
        S = len(sch)
        input_ids, lens, starts, cu, seq_idx, positions = flat_batch(sch)
        T = len(input_ids)
        seq_lens = starts + lens
        widths = -(-seq_lens // bs)
        bt = np.zeros((S, int(widths.max())), dtype=np.int64)
        for i, s in enumerate(sch):
            bt[i, :widths[i]] = s.block_ids[:widths[i]]
        flat = np.empty((3, T), dtype=np.int64)
        flat[0] = input_ids
        flat[1] = positions
        flat[2] = bt[seq_idx, positions // bs] * bs + positions % bs
        D = int(np.count_nonzero(lens == 1))
        assert D == 0 or lens[:D].max() == 1, "decodes must come first"
        dev = self.device
        ids, pos, slots = torch.from_numpy(flat).to(dev, non_blocking=True)
        b = TorchBatch(ids, pos, slots, block_size=bs)
        if D:
            width = int(widths[:D].max())
            b.decode_tables = torch.from_numpy(np.ascontiguousarray(bt[:D, :width])).to(dev, non_blocking=True)
            b.decode_lens = torch.from_numpy(seq_lens[:D]).to(dev, non_blocking=True)
        for i in range(D, S):
            table = torch.from_numpy(np.ascontiguousarray(bt[i, :widths[i]])).to(dev, non_blocking=True)
            b.prefills.append(PrefillChunk(int(cu[i]), int(lens[i]), int(starts[i]), table))
        return b, cu

    def _step(self, sch: list[ScheduledRequest], inputs=None, masks: SchedulerOutput | None = None) -> RunnerOutput:
        result = RunnerOutput()
        if any(s.draft_token_ids for s in sch):
            sch = self._expand(sch)
            inputs = None
        b, cu = inputs or self._inputs(sch)
        T = b.input_ids.shape[0]
        sample_rows = [i for i, s in enumerate(sch) if s.sample and s.params.pooling is None]
        pool_rows = [i for i, s in enumerate(sch) if s.params.pooling is not None]
        wants_prompt = [s.params.prompt_logprobs is not None and s.start < len(s.prompt_token_ids) - 1 for s in sch]
        hidden = None
        if (self.graphs is not None and not b.prefills and len(sample_rows) == T and not pool_rows
                and not any(wants_prompt)):
            logits = self.graphs.run(b.input_ids, b.positions, b.slots, b.decode_tables, b.decode_lens)
        else:
            hidden = forward(self.model, b, self.kv_cache)
            if sample_rows:
                last = torch.from_numpy(cu[1:][sample_rows] - 1).to(self.device)
                logits = self.model.logits(hidden if len(sample_rows) == T else hidden.index_select(0, last))
        if sample_rows:
            batch = self._sampling_batch([sch[i] for i in sample_rows], masks)
            unchanged = (batch.token_mask is None and not batch.banned and batch.logit_bias is None
                         and batch.output_ids is None)
            if batch.all_greedy and unchanged and batch.num_logprobs is None:
                so = SamplerOutput(token_ids=logits.argmax(-1).tolist())
            else:
                so = sample(logits.cpu(), batch)
            self._collect(sch, sample_rows, so, result)
        for i in pool_rows:
            s = sch[i]
            rows = hidden[cu[i]:cu[i + 1]]
            if s.params.pooling == "mean":
                result.pooled[s.request_id] = (s.start, rows.shape[0], rows.float().sum(0).cpu())
            elif s.params.pooling == "cls":
                if s.start == 0:
                    result.pooled[s.request_id] = (0, 1, rows[0].float().cpu())
            elif s.sample:
                result.pooled[s.request_id] = (s.start, 1, rows[-1].float().cpu())
        for i, s in enumerate(sch):
            if wants_prompt[i]:
                n = min(len(s.token_ids), len(s.prompt_token_ids) - 1 - s.start)
                rows = hidden[cu[i]:cu[i] + n]
                result.prompt_logprobs[s.request_id] = self._prompt_logprobs_of(s, self.model.logits(rows).cpu())
        return result
