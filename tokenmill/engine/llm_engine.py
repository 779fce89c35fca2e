"""The synchronous engine core: add requests, step, abort.

    out = scheduler.schedule()
    result = runner.execute(out)
    produced = scheduler.update(out, result.sampled)

then text, stop strings and logprobs become `RequestOutput`s. The engine sees token
ids only; chat templates and tokenization of prompts stay with the caller.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import time

import torch

from tokenmill.config import EngineConfig, default_cache_bytes, default_num_threads
from tokenmill.engine.api import RequestLimits, check_knobs
from tokenmill.engine.front import generation_defaults
from tokenmill.engine.types import (EngineStats, GenerationDefaults, InvalidParameter, Priority, RequestOutput,
                                    ResolvedParams, SamplingParams)
from tokenmill.engine.output import OutputProcessor
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.device import describe as describe_device, gpu_cache_bytes, resolve as resolve_device
from tokenmill.engine.runner import ModelRunner
from tokenmill.engine.scheduler import Scheduler
from tokenmill.engine.structured.matchers import GrammarMatchers
from tokenmill.engine.torch_runner import TorchRunner
from tokenmill.kv.cache import KVCache
from tokenmill.kv.manager import KVCacheManager
from tokenmill.kv.tier import open_disk_tier
from tokenmill.model.kernels import native_ops, native_ops_for
from tokenmill.model.loader import LoadedModel
from tokenmill.model.torch_paged import TorchKVCache, move_model

log = logging.getLogger("tokenmill.engine")


class LLMEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None,
                 defaults: GenerationDefaults | None = None):
        """`defaults`: what `add_request` fills a silent SamplingParams with (the engine
        fronts resolve requests themselves and pass ResolvedParams)."""
        config = resolve_device(config or EngineConfig())
        self.defaults = defaults or generation_defaults({}, config.model)
        torch.set_num_threads(config.num_threads or default_num_threads())
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        mcfg = loaded.config
        self.model_config = mcfg
        max_len = min(config.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings)
        self.config = dataclasses.replace(
            config, scheduler=dataclasses.replace(config.scheduler, max_model_len=max_len))
        cc = config.cache
        dtype = loaded.model.dtype
        kv_dtype = torch.int8 if cc.kv_cache_dtype == "int8" else dtype
        per_block = KVCache.bytes_per_block(mcfg.num_layers, mcfg.num_kv_heads, cc.block_size,
                                            mcfg.head_dim, kv_dtype)
        on_torch = config.runner == "torch"
        if on_torch:  # the weights first, so that the KV pool gets what they leave of the device
            move_model(loaded.model, torch.device(config.device))
        if cc.num_blocks is not None:
            num_blocks = cc.num_blocks
        else:
            if cc.kv_cache_gb:
                budget = cc.kv_cache_gb * 1024 ** 3
            elif config.device == "cuda":
                budget = gpu_cache_bytes(cc.gpu_memory_utilization, *torch.cuda.mem_get_info())
            else:
                budget = default_cache_bytes()
            num_blocks = int(budget // per_block)
        if num_blocks < 1:
            raise ValueError(f"the KV cache budget holds no block of {per_block} bytes")
        if on_torch:
            self.kv_cache = TorchKVCache(mcfg.num_layers, mcfg.num_kv_heads, num_blocks, cc.block_size,
                                         mcfg.head_dim, dtype, torch.device(config.device))
        else:
            self.kv_cache = KVCache(mcfg.num_layers, mcfg.num_kv_heads, num_blocks, cc.block_size,
                                    mcfg.head_dim, dtype, kv_dtype)
        tier = None
        if cc.kv_disk_dir:  # its files are bound to the kernels that computed them, and the attention path
            kernels = f"{getattr(native_ops(), '__name__', 'none')}/{'native' if config.native_attention else 'torch'}"
            tier = open_disk_tier(cc, loaded, self.kv_cache, kernels)
        self.kv = KVCacheManager(num_blocks, cc.block_size, cc.enable_prefix_caching, tier,
                                 cc.pin_share_per_tenant)
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids if self.tokenizer else mcfg.eos_token_ids)
        self.grammar = GrammarMatchers(self.tokenizer, mcfg.vocab_size, self.eos_token_ids)
        self.scheduler = Scheduler(self.config.scheduler, self.kv, self.grammar)
        self.limits = RequestLimits(max_len, self.scheduler.cache_tokens, mcfg.vocab_size, config.bounds)
        self.adapters = None  # LoRA (engine/adapters.py): slots in the model before the runner binds it
        if config.lora.max_loras:
            from tokenmill.engine.adapters import Adapters

            ops = native_ops_for(mcfg.head_dim) if config.native_attention else None
            self.adapters = Adapters(loaded.model, config.lora, ops)
        if on_torch:
            graphs = config.device == "cuda" and config.cuda_graphs
            self.runner = TorchRunner(loaded.model, self.kv_cache, cc.block_size, torch.device(config.device),
                                      max_rows=config.scheduler.max_num_seqs if graphs else 0,
                                      max_blocks=-(-max_len // cc.block_size))
        else:
            self.runner = ModelRunner(loaded.model, self.kv_cache, cc.block_size, config.native_attention)
        self.outputs = OutputProcessor(self.tokenizer)
        self._groups: dict[str, list[str]] = {}  # user request id -> its samples' ids
        self._deadlines: list[tuple[float, str]] = []  # heap of (deadline, user request id)
        self.prompt_tokens_computed = 0
        self.generation_tokens = 0
        self.steps = 0
        log.info("KV cache: %d blocks x %d tokens (%.2f GiB, %s) on %s", num_blocks, cc.block_size,
                 num_blocks * per_block / 1024 ** 3, str(kv_dtype).removeprefix("torch."), describe_device(config))

    # -- requests -----------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | ResolvedParams,
                    **kwargs) -> None:
        """Queue a request (n samples); SamplingParams are resolved first, as the server
        resolves a request (RequestLimits.resolve under this engine's defaults). Raises
        InvalidParameter / AdmissionError, having scheduled nothing, when it can never be
        served. Past `deadline` (time.monotonic) the request is aborted and its blocks
        freed: its answer can no longer be useful."""
        if not isinstance(params, ResolvedParams):
            params = self.limits.resolve([prompt_token_ids], params, defaults=self.defaults)
        self.add_resolved(request_id, prompt_token_ids, params, **kwargs)

    def add_resolved(self, request_id: str, prompt_token_ids: list[int], params: ResolvedParams,
                     *, priority: int = Priority.INTERACTIVE, cache_salt: str | None = None,
                     tenant: str | None = None, arrival_time: float | None = None,
                     deadline: float | None = None, lora: str | None = None) -> None:
        """`lora`: the name of the LoRA adapter the request runs under (None: the base model)."""
        if request_id in self._groups:
            raise InvalidParameter("request_id", f"duplicate request id {request_id!r}")
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        slot = -1
        if lora is not None:
            if self.adapters is None:
                raise InvalidParameter("model", f"no LoRA adapter named {lora!r} (this engine has none)")
            slot, salt = self.adapters.acquire(request_id, lora)  # (released when the request ends)
            cache_salt = salt if cache_salt is None else f"{salt}|{cache_salt}"
        reqs = [
            Request(request_id if params.n == 1 else f"{request_id}#{i}", prompt_token_ids, params,
                    group_id=request_id, index=i, priority=priority, cache_salt=cache_salt,
                    tenant=tenant, arrival_time=arrival, eos_token_ids=self.eos_token_ids, lora_slot=slot)
            for i in range(params.n)
        ]
        try:
            if params.structured is not None:  # raises InvalidParameter before anything is queued
                for r in reqs:
                    self.grammar.add(r.request_id, params.structured)
        except BaseException:
            if self.adapters is not None:
                self.adapters.release(request_id)
            raise
        self.scheduler.add_requests(reqs)
        for r in reqs:
            self.outputs.add(r)
        self._groups[request_id] = [r.request_id for r in reqs]
        if deadline is not None:
            heapq.heappush(self._deadlines, (deadline, request_id))

    def abort(self, request_id: str, reason: str | None = None) -> list[RequestOutput]:
        """Abort every sample of a user request now; its blocks are freed at once."""
        outs = []
        if self.adapters is not None:
            self.adapters.release(request_id)
        for rid in self._groups.pop(request_id, []):
            req = self.scheduler.finish(rid, RequestStatus.FINISHED_ABORTED, reason)
            if req is not None:
                out = self.outputs.finished_output(req)
                if out is not None:
                    outs.append(out)
        return outs

    def load_adapter(self, name: str, path: str):
        """Read a LoRA adapter into a slot (engine/adapters.py): its AdapterInfo."""
        if self.adapters is None:
            raise InvalidParameter("lora_name", "this engine serves no LoRA adapters (start it with --max-loras N)")
        return self.adapters.load(name, path)

    def unload_adapter(self, name: str) -> None:
        if self.adapters is None:
            raise InvalidParameter("lora_name", f"no adapter named {name!r} is loaded")
        self.adapters.unload(name)

    def tune(self, knobs: dict[str, int]) -> None:
        """Scheduling knobs (api.TUNABLE) changed while serving; the scheduler reads its
        config every step, and nothing else was sized by them."""
        self.scheduler.config = dataclasses.replace(self.scheduler.config, **check_knobs(knobs))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def close(self) -> None:
        """Flush the disk tier's pending writes and release its directory."""
        if self.kv.tier is not None:
            self.kv.tier.close()

    # -- the step -----------------------------------------------------------------------
    def _expire(self) -> list[RequestOutput]:
        outs: list[RequestOutput] = []
        now = time.monotonic()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, rid = heapq.heappop(self._deadlines)
            outs += self.abort(rid, reason="deadline")
        return outs

    def step(self) -> list[RequestOutput]:
        expired = self._expire() if self._deadlines else []
        out = self.scheduler.schedule()
        if not out.scheduled:
            self.kv.poll_restores(timeout=0.005)  # only reads from disk in flight: wait for one
            return expired
        result = self.runner.execute(out)
        produced = self.scheduler.update(out, result.sampled)
        self.steps += out.num_steps
        self.prompt_tokens_computed += sum(
            len(s.token_ids) for s in out.scheduled if s.start < len(s.prompt_token_ids))
        for stop in self.outputs.find_stops(produced):  # stop strings in the new text
            self.scheduler.stop(stop.request, stop.num_output_tokens, stop.reason)
        outputs = self.outputs.emit(produced, result)
        for o in outputs:
            self.generation_tokens += len(o.new_token_ids)
            if o.finished:
                self._forget(o)
        return expired + outputs

    def _forget(self, out: RequestOutput) -> None:
        ids = self._groups.get(out.request_id)
        if ids is not None and all(rid not in self.scheduler.requests for rid in ids):
            del self._groups[out.request_id]
            if self.adapters is not None:
                self.adapters.release(out.request_id)

    def stats(self) -> EngineStats:
        st = self.kv.stats
        spec = self.scheduler.spec.stats if self.scheduler.spec is not None else None
        oldest = self.scheduler.waiting.oldest_arrival(Priority.INTERACTIVE)
        return EngineStats(
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            num_waiting_interactive=self.scheduler.waiting.count(Priority.INTERACTIVE),
            num_waiting_batch=self.scheduler.waiting.count(Priority.BATCH),
            oldest_waiting_s=0.0 if oldest is None else time.monotonic() - oldest,
            kv_blocks_used=self.kv.num_used_blocks, kv_blocks_total=self.kv.num_blocks,
            prefix_queries=st.queries, prefix_hits=st.hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens_computed=self.prompt_tokens_computed,
            generation_tokens=self.generation_tokens, steps=self.steps,
            spec_draft_tokens=spec.draft_tokens if spec else 0,
            spec_accepted_tokens=spec.accepted_tokens if spec else 0,
            spec_verifications=spec.verifications if spec else 0,
            kv_pinned_blocks=len(self.kv.pins),
            **(self.kv.tier.engine_stats() if self.kv.tier is not None else {}),
        )
