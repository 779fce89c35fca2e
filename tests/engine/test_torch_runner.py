"""The torch runner (issue 46: the engine's path for a GPU, PyTorch ops only) run on the
CPU: its logits equal the exact mode's (float32, the native kernels) on tiny random
checkpoints of three families, in prefill chunks, decode steps and after cached context;
through the engine a request's tokens are the same batched or alone, after a prefix-cache
hit and after preemption as in a cold run; the CUDA-graph buckets (capture replaced by
eager calls on the same buffers) choose, pad and fall back as they should and give the
unbucketed step's tokens."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers import full_logits, run_to_completion, tiny_loaded
from tokenmill.config import CacheConfig, EngineConfig, ModelOptions, SchedulerConfig
from tokenmill.engine.api import SamplingParams
from tokenmill.engine.decode_graphs import DecodeGraphs, eager_capture
from tokenmill.engine.device import gpu_cache_bytes, resolve
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.torch_runner import TorchRunner
from tokenmill.model.kernels import native_ops_for
from tokenmill.model.torch_paged import PrefillChunk, TorchBatch, TorchKVCache, forward, move_model

BS = 16


def torch_logits(model, ids: list[int], chunk: int | None = None) -> torch.Tensor:
    """Logits at every position through the torch runner's model path, as
    tests/helpers.full_logits does for the CPU paths (a chunk of 1: decode steps)."""
    cfg = model.cfg
    nblocks = -(-len(ids) // BS)
    kv = TorchKVCache(cfg.num_layers, cfg.num_kv_heads, nblocks, BS, cfg.head_dim, model.dtype, torch.device("cpu"))
    table = torch.arange(nblocks - 1, -1, -1)  # not the identity
    out, step = [], chunk or len(ids)
    for s in range(0, len(ids), step):
        n = min(step, len(ids) - s)
        pos = torch.arange(s, s + n)
        b = TorchBatch(torch.tensor(ids[s:s + n]), pos, table[pos // BS] * BS + pos % BS, block_size=BS)
        if n == 1 and s > 0:
            b.decode_tables, b.decode_lens = table[:s // BS + 1].view(1, -1), torch.tensor([s + 1])
        else:
            b.prefills.append(PrefillChunk(0, n, s, table[:-(-(s + n) // BS)]))
        out.append(model.logits(forward(model, b, kv)))
    return torch.cat(out)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Tiny float32 models: Llama (GQA), Qwen3 (QK-norm), Gemma 3 (sliding window of 8
    keys, its own local RoPE base, norms on both outputs)."""
    transformers = pytest.importorskip("transformers")  # noqa: F841
    from tests.model.test_families import make_checkpoint
    from tokenmill.model.loader import load_model

    models = {"llama": tiny_loaded().model}
    for kind in ("qwen3", "gemma3"):
        folder = tmp_path_factory.mktemp(kind)
        make_checkpoint(kind, folder)
        models[kind] = load_model(str(folder), "float32", "none").model
    return models


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma3"])
def test_logits_equal_the_exact_mode(checkpoints, kind):
    model = move_model(checkpoints[kind], torch.device("cpu"))
    ids = torch.randint(3, 290, (40,), generator=torch.Generator().manual_seed(7)).tolist()
    exact = full_logits(model, ids, kernel=native_ops_for(model.cfg.head_dim))
    for chunk in (None, 13, 1):  # one prefill; chunks after cached context; decode steps
        ours = torch_logits(model, ids, chunk)
        assert (ours - exact).abs().max().item() < 1e-4, chunk


def _engine(loaded, num_blocks: int = 64, max_num_seqs: int = 16, budget: int = 512, prefix: bool = True):
    cfg = EngineConfig(cache=CacheConfig(block_size=BS, num_blocks=num_blocks, enable_prefix_caching=prefix),
                       scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget),
                       runner="torch")
    engine = LLMEngine(loaded, cfg)
    assert isinstance(engine.runner, TorchRunner)
    return engine


def _prompt(n: int, k: int) -> list[int]:
    return [(13 * k + 7 * j) % 290 + 5 for j in range(n)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded():
    return tiny_loaded(layers=2, seed=3)


@pytest.fixture(scope="module")
def alone(loaded):
    """Each request run by itself on a fresh engine: the cold reference."""
    reqs = _requests()
    return {rid: run_to_completion(_engine(loaded), {rid: reqs[rid]})[0][rid] for rid in reqs}


def _requests():
    return {f"r{k}": (_prompt(5 + 11 * k, k), SEEDED if k % 2 else GREEDY) for k in range(5)}


def test_the_engine_on_the_torch_runner_gives_the_native_runners_tokens(loaded, alone):
    native = LLMEngine(loaded, EngineConfig(cache=CacheConfig(block_size=BS, num_blocks=64)))
    reqs = _requests()
    assert {rid: run_to_completion(native, {rid: reqs[rid]})[0][rid] for rid in reqs} == alone


def test_batched_equals_alone(loaded, alone):
    engine = _engine(loaded)
    assert run_to_completion(engine, _requests())[0] == alone
    engine.kv.check_integrity()


def test_prefix_hits_and_chunks_equal_a_cold_run(loaded, alone):
    engine = _engine(loaded, budget=20)  # prompts of 38 and 49 tokens prefill in chunks
    reqs = _requests()
    run_to_completion(engine, {"warm": reqs["r4"]})
    engine.add_request("again", *reqs["r4"])
    toks, cached = [], []
    while engine.has_unfinished():
        for o in engine.step():
            toks += o.new_token_ids
            cached.append(o.num_cached_tokens)
    assert max(cached) >= 3 * BS  # the prompt's full blocks came from the cache
    assert toks == alone["r4"][0]


def test_preemption_resumes_as_a_cold_run(loaded, alone):
    # 6 blocks for requests that need 2-5 each: someone is preempted and recomputed
    engine = _engine(loaded, num_blocks=6, prefix=False)
    reqs = _requests()
    toks, _, _ = run_to_completion(engine, reqs, check=lambda e: e.kv.check_integrity())
    assert engine.scheduler.num_preemptions >= 1
    assert toks == alone


def test_graph_buckets_choose_pad_and_fall_back():
    calls = []

    def step(ids, pos, slots, tables, lens):
        calls.append((ids.shape[0], tables.shape[1], tables.clone(), lens.clone(), slots.clone()))
        return torch.stack([ids.float(), lens.float()], 1)

    g = DecodeGraphs(step, max_rows=24, max_blocks=10, scratch_block=99, device=torch.device("cpu"),
                     capture=eager_capture)
    g.block_size = 4
    assert g.rows == [1, 2, 4, 8, 16, 24] and g.widths == [1, 2, 4, 8, 10]
    assert g.bucket(3, 3) == (4, 4) and g.bucket(24, 10) == (24, 10) and g.bucket(17, 1) == (24, 1)
    assert g.bucket(25, 1) is None and g.bucket(1, 11) is None
    out = g.run(torch.tensor([5, 6, 7]), torch.tensor([8, 0, 2]), torch.tensor([33, 40, 2]),
                torch.tensor([[8, 3, 0], [10, 0, 0], [0, 0, 0]]), torch.tensor([9, 1, 3]))
    assert out.tolist() == [[5, 9], [6, 1], [7, 3]]  # the real rows only
    rows, width, tables, lens, slots = calls[-1]
    assert (rows, width) == (4, 4)
    assert tables[3].tolist() == [99] * 4 and tables[0].tolist() == [8, 3, 0, 99]  # padding: the scratch block
    assert lens.tolist() == [9, 1, 3, 1] and slots[3].item() == 99 * 4
    n = len(calls)
    g.run(torch.tensor([1]), torch.tensor([0]), torch.tensor([4]), torch.tensor([[1]]), torch.tensor([1]))
    assert calls[-1][:2] == (1, 1) and len(g.graphs) == 2 and len(calls) == n + 2  # captured, then replayed
    g.run(torch.tensor([1]), torch.tensor([0]), torch.tensor([4]), torch.tensor([[1]]), torch.tensor([1]))
    assert len(calls) == n + 3  # a bucket seen before: replayed only
    wide = g.run(torch.tensor([1]), torch.tensor([0]), torch.tensor([4]), torch.ones(1, 11, dtype=torch.long),
                 torch.tensor([1]))
    assert calls[-1][:2] == (1, 11) and wide.shape == (1, 2) and len(g.graphs) == 2  # eager: no bucket


def test_graph_buckets_give_the_unbucketed_tokens(loaded, alone):
    engine = _engine(loaded)
    r = engine.runner
    engine.runner = TorchRunner(loaded.model, r.kv_cache, BS, r.device, max_rows=8, max_blocks=4, cuda_graphs=False)
    # five decode rows in the 8-row bucket (three rows of padding) while every context fits
    # 4 blocks; eagerly once the longest needs a fifth
    assert run_to_completion(engine, _requests())[0] == alone
    assert set(engine.runner.graphs.graphs) == {(8, 4)}


def test_device_resolution_and_gpu_sizing():
    base = EngineConfig(model=ModelOptions(quantization="auto"))
    cpu = resolve(dataclasses.replace(base, device="auto"))
    if not torch.cuda.is_available():
        assert (cpu.device, cpu.runner, cpu.model.quantization) == ("cpu", "native", "auto")
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve(dataclasses.replace(base, device="cuda"))
    on_torch = resolve(dataclasses.replace(base, runner="torch"))
    assert (on_torch.device, on_torch.runner, on_torch.model.quantization) == ("cpu", "torch", "none")
    with pytest.raises(ValueError, match="dense weights"):
        resolve(dataclasses.replace(base, runner="torch", model=ModelOptions(quantization="int4")))
    with pytest.raises(ValueError, match="native runner runs on the CPU only"):
        EngineConfig(device="cuda", runner="native")
    GiB = 1024 ** 3
    # 80 GiB card, 60 free after the weights: at 0.9 the process may hold 72, so the pool gets 52
    assert gpu_cache_bytes(0.9, 60 * GiB, 80 * GiB) == 52 * GiB
    assert gpu_cache_bytes(0.5, 30 * GiB, 80 * GiB) == 0  # already past the share: nothing


def _collect(engine, reqs):
    """{request id: (tokens, [(token, logprob, top)] of the output, [(token, logprob)] of the prompt, drafts)}"""
    got: dict[str, list] = {rid: [[], [], [], 0] for rid in reqs}
    for rid, (ids, params) in reqs.items():
        engine.add_request(rid, ids, params)
    while engine.has_unfinished():
        for o in engine.step():
            g = got[o.request_id]
            g[0] += o.new_token_ids
            g[1] += [(t.token_id, t.logprob, t.top) for t in o.logprobs or []]
            g[2] += [(t.token_id, t.logprob) for t in o.prompt_logprobs or [] if t is not None]
            g[3] = max(g[3], o.num_draft_tokens)
    return got


def test_logprobs_penalties_and_drafts_as_on_the_native_runner(loaded):
    """The steps the device cannot finish alone (logprobs, penalties, prompt logprobs: the
    host sampler; speculative drafts: decode rows of one request) give the native runner's
    tokens, and its logprobs within 1e-4."""
    from tokenmill.config import SpeculativeConfig

    reqs = {"lp": (_prompt(21, 1), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3,
                                                  prompt_logprobs=2)),
            "pen": (_prompt(30, 2), SamplingParams(temperature=0.8, seed=5, top_k=40, presence_penalty=0.5,
                                                   repetition_penalty=1.2, max_tokens=12, ignore_eos=True)),
            # its greedy output repeats itself ("189, 189, 189"): an n-gram draft is checked
            "spec": (_prompt(12, 2), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))}
    sched = SchedulerConfig(max_num_seqs=8, speculative=SpeculativeConfig(method="ngram"))
    runs = {}
    for runner in ("native", "torch"):
        cfg = EngineConfig(cache=CacheConfig(block_size=BS, num_blocks=64), scheduler=sched, runner=runner)
        runs[runner] = _collect(LLMEngine(loaded, cfg), {k: v for k, v in reqs.items() if k != "spec"})
        runs[runner].update(_collect(LLMEngine(loaded, cfg), {"spec": reqs["spec"]}))
    native, ours = runs["native"], runs["torch"]
    assert ours["spec"][3] > 0  # drafts were checked
    for rid in reqs:
        assert ours[rid][0] == native[rid][0], rid
    assert len(ours["lp"][1]) == 12 and len(ours["lp"][2]) == 20
    for (t, lp, top), (nt, nlp, ntop) in zip(ours["lp"][1], native["lp"][1]):
        assert t == nt and abs(lp - nlp) < 1e-4 and [i for i, _ in top] == [i for i, _ in ntop]
    for (t, lp), (nt, nlp) in zip(ours["lp"][2], native["lp"][2]):
        assert t == nt and abs(lp - nlp) < 1e-4
