"""LoRA adapters (tokenmill/model/lora.py, engine/adapters.py) against transformers +
peft on tiny random Llama and Qwen2 checkpoints made here, with adapters made by peft
(random, non-zero B) and their llama.cpp-format GGUF twins written with gguf."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from tests.helpers import full_logits
from tokenmill.config import CacheConfig, EngineConfig, LoraConfig, SchedulerConfig
from tokenmill.engine.api import SamplingParams
from tokenmill.engine.types import InvalidParameter
from tokenmill.model.kernels import native_ops
from tokenmill.model.lora import AdapterError, load_adapter

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
ops = native_ops()

BASE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=64, vocab_size=320, max_position_embeddings=256, rms_norm_eps=1e-6,
            tie_word_embeddings=False)
KINDS = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
         "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# three adapters: every projection at rank 8, attention only at rank 4, the MLP and v at rank 16
ADAPTERS = {"a1": (ALL, 8, 1), "a2": (["q_proj", "k_proj", "o_proj"], 4, 2), "a3": (["v_proj", "gate_proj",
                                                                                      "up_proj", "down_proj"], 16, 3)}


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=sorted(KINDS))
def kit(request, tmp_path_factory):
    """(kind, base folder, transformers base model, {adapter: (folder, peft model)})."""
    cfg_cls, model_cls = KINDS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    base = model_cls(cfg_cls(**BASE)).eval()
    base.save_pretrained(root / "base", safe_serialization=True)
    adapters = {}
    for name, (targets, r, seed) in ADAPTERS.items():
        torch.manual_seed(seed)
        conf = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False,
                               lora_dropout=0.0)
        pm = peft.get_peft_model(copy.deepcopy(base), conf)
        with torch.no_grad():  # (kaiming-uniform A and B: an update the size of the base's output)
            for n, p in pm.named_parameters():
                if "lora_B" in n:
                    p.mul_(0.25)
        pm.save_pretrained(root / name)
        adapters[name] = (root / name, pm.eval())
    return request.param, root / "base", base, adapters


def _engine(loaded, adapters: dict, max_loras: int = 4, **sched):
    from tokenmill.engine.llm_engine import LLMEngine

    cfg = EngineConfig(cache=CacheConfig(block_size=4, num_blocks=128),
                       scheduler=SchedulerConfig(**{"max_num_seqs": 16, "decode_steps": 1, **sched}),
                       lora=LoraConfig(tuple((n, str(f)) for n, (f, _) in adapters.items()), max_loras, 32))
    return LLMEngine(loaded, cfg)


def _hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _run(engine, requests):
    """Each request's tokens and logprobs (bit for bit), and its cached prompt tokens."""
    got, cached = {}, {}
    for rid, (ids, model) in requests.items():
        engine.add_request(rid, ids, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2),
                           lora=model)
    while engine.has_unfinished():
        for out in engine.step():
            toks, lps = got.setdefault(out.request_id, ([], []))
            toks.extend(out.new_token_ids)
            lps.extend((lp.logprob, tuple(lp.top)) for lp in out.logprobs or [])
            cached[out.request_id] = out.num_cached_tokens
    return got, cached


def test_exact_mode_equals_peft(kit):
    """float32: each adapter's logits (one prefill, and token by token through the decode
    path) equal transformers + peft on the same weights; the base model's stay the base's."""
    from tokenmill.model.loader import load_model

    kind, base_dir, base, adapters = kit
    engine = _engine(load_model(str(base_dir), "float32"), adapters)
    model = engine.runner.model
    ids = _ids(24, seed=5)
    assert (full_logits(model, ids, kernel=ops) - _hf_logits(base, ids)).abs().max().item() < 1e-4
    for name, (_, pm) in adapters.items():
        slot = engine.adapters.slots.slot_of(name)
        want = _hf_logits(pm, ids)
        assert (want - _hf_logits(base, ids)).abs().max().item() > 0.05, "the adapter changes nothing"
        for chunk in (None, 1):
            got = full_logits(model, ids, chunk=chunk, kernel=ops, lora_slot=slot)
            assert (got - want).abs().max().item() < 1e-4, (name, chunk)
    # and greedy through the engine equals peft's greedy continuation
    out, _ = _run(engine, {name: (ids, name) for name in adapters})
    for name, (_, pm) in adapters.items():
        seq = list(ids)
        for _ in range(10):
            seq.append(int(_hf_logits(pm, seq)[-1].argmax()))
        assert out[name][0] == seq[len(ids):], name


class _Counting:
    """Stands in for the native DecodeModel to count the rows of its fused steps."""

    def __init__(self, inner):
        self.inner, self.rows = inner, []

    def forward_logits(self, ids, *args):
        self.rows.append(ids.shape[0])
        return self.inner.forward_logits(ids, *args)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("mode", ["exact", "default"])
def test_mixed_batch_equals_each_alone(kit, mode):
    """Base and three adapters in one batch give each request's tokens and logprobs as it
    gets run alone: bit for bit in the default mode (int4, bfloat16), where the batch's
    decodes run through the native fused step, adapters inside it. In the exact mode the
    tokens are equal and the logprobs within 1e-5: its float32 matmuls (torch's) sum in
    an order that depends on the batch's rows, adapters or not (the base request shows it)."""
    from tokenmill.model.loader import load_model

    kind, base_dir, _, adapters = kit
    loaded = load_model(str(base_dir), *(("float32", "none") if mode == "exact" else ("bfloat16", "int4")))
    requests = {"base": (_ids(9, seed=1), None), "a1": (_ids(17, seed=2), "a1"), "a2": (_ids(5, seed=3), "a2"),
                "a3": (_ids(12, seed=4), "a3"), "a1-again": (_ids(7, seed=6), "a1")}
    engine = _engine(loaded, adapters)
    counter = None
    if mode == "default" and ops is not None and ops.decode_step_available():
        assert engine.runner.fused is not None, "the int4 model has no fused step"
        counter = engine.runner.fused.native = _Counting(engine.runner.fused.native)
    together, _ = _run(engine, requests)
    if counter is not None:
        assert max(counter.rows) == len(requests), "the mixed batch did not decode through the fused step"
    for rid, req in requests.items():
        alone, _ = _run(_engine(loaded, adapters), {rid: req})
        if mode == "default":
            assert alone[rid] == together[rid], rid
        else:
            assert alone[rid][0] == together[rid][0], rid
            assert np.allclose([lp for lp, _ in alone[rid][1]], [lp for lp, _ in together[rid][1]], atol=1e-5, rtol=0)
    assert len({tuple(t) for t, _ in together.values()}) == len(requests)  # each adapter answers its own way


def test_fused_step_equals_separate_ops_with_adapters(kit):
    """The fused decode step's adapter updates (split by columns across its threads) give
    the separate native ops' numbers (split by rows): a decode row on an adapter gets the
    same tokens and logprobs whichever path its step takes."""
    from tokenmill.model.loader import load_model

    if ops is None or not ops.decode_step_available():
        pytest.skip("the fused step needs the native build with AVX-512 VNNI and BF16, or AVX2 without AVX-512")
    _, base_dir, _, adapters = kit
    loaded = load_model(str(base_dir), "bfloat16", "int4")
    requests = {"a1": (_ids(9, seed=1), "a1"), "a2": (_ids(13, seed=2), "a2"), "base": (_ids(5, seed=3), None),
                "a3": (_ids(11, seed=4), "a3")}
    results = {}
    for fused in (True, False):
        engine = _engine(loaded, adapters)
        if fused:
            counter = engine.runner.fused.native = _Counting(engine.runner.fused.native)
        else:
            engine.runner.fused = None
        results[fused] = _run(engine, requests)[0]
    assert counter.rows and results[True] == results[False]


def test_gguf_twin_equals_peft_folder(kit, tmp_path):
    """The llama.cpp LoRA GGUF of the same weights (llama-arch q/k rows interleaved as
    llama.cpp's converter writes them) gives the folder's logits."""
    import gguf

    from tokenmill.model.gguf_loader import _reverse_permute
    from tokenmill.model.loader import load_model

    kind, base_dir, _, adapters = kit
    folder, pm = adapters["a1"]
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    path = tmp_path / "a1.gguf"
    w = gguf.GGUFWriter(str(path), kind)
    w.add_type("adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", 16.0)
    for n, p in pm.named_parameters():
        if "lora_" not in n:
            continue
        layer = int(n.split(".layers.")[1].split(".")[0])
        module = n.split(".lora_")[0].rsplit(".", 1)[1]
        t = p.detach().float().numpy()
        ab = "a" if ".lora_A." in n else "b"
        if ab == "b" and kind == "llama" and module in ("q_proj", "k_proj"):
            heads = BASE["num_attention_heads"] if module == "q_proj" else BASE["num_key_value_heads"]
            t = _forward_permute(t, heads)
            assert np.array_equal(_reverse_permute(t, heads), p.detach().float().numpy())
        w.add_tensor(f"blk.{layer}.{names[module]}.weight.lora_{ab}", np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    loaded = load_model(str(base_dir), "float32")
    engine = _engine(loaded, {"a1": adapters["a1"]})
    info = engine.load_adapter("a1-gguf", str(path))
    assert info.rank == 8 and len(info.modules) == 7
    slots = engine.adapters.slots
    ids = _ids(20, seed=8)
    assert torch.equal(full_logits(loaded.model, ids, kernel=ops, lora_slot=slots.slot_of("a1-gguf")),
                       full_logits(loaded.model, ids, kernel=ops, lora_slot=slots.slot_of("a1")))


def _forward_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order (its RoPE pairs adjacent values)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_prefix_cache_never_shares_across_adapters(kit):
    from tokenmill.model.loader import load_model

    _, base_dir, _, adapters = kit
    engine = _engine(load_model(str(base_dir), "float32"), adapters)
    ids = _ids(24, seed=7)
    seen = {}
    for i, model in enumerate([None, "a1", "a2", "a1", None]):
        _, cached = _run(engine, {f"r{i}": (ids, model)})
        seen[i] = cached[f"r{i}"]
    assert seen[0] == seen[1] == seen[2] == 0  # base, a1, a2: each computes the prompt
    assert seen[3] > 0 and seen[4] > 0  # a1 again, base again: their own blocks


def test_bad_adapters_are_refused_and_change_nothing(kit, tmp_path):
    from safetensors.torch import save_file

    from tokenmill.model.loader import load_model

    kind, base_dir, _, adapters = kit
    loaded = load_model(str(base_dir), "float32")
    engine = _engine(loaded, {"a1": adapters["a1"]}, max_loras=2)
    before = engine.adapters.listing()
    src = adapters["a3"][0]
    with pytest.raises(AdapterError, match="above --max-lora-rank"):  # rank 16 over a cap of 8
        load_adapter("big", str(src), loaded.config, max_rank=8)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
    (bad / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(AdapterError, match="not a readable safetensors"):
        engine.load_adapter("corrupt", str(bad))
    conf = json.loads((src / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps(conf))
    save_file({"base_model.model.model.layers.0.mlp.down_proj.lora_A.weight": torch.zeros(16, 7),
               "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight": torch.zeros(128, 16)},
              str(bad / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="do not fit the base model"):
        engine.load_adapter("misfit", str(bad))
    with pytest.raises(AdapterError, match="does not exist"):
        engine.load_adapter("missing", str(tmp_path / "nowhere"))
    with pytest.raises(InvalidParameter, match="already loaded"):
        engine.load_adapter("a1", str(src))
    with pytest.raises(InvalidParameter, match="no LoRA adapter named"):
        engine.add_request("x", [5, 6], SamplingParams(max_tokens=1), lora="corrupt")
    assert engine.adapters.listing() == before
    out, _ = _run(engine, {"still": (_ids(6, seed=1), "a1")})
    assert len(out["still"][0]) == 10


def test_slots_evict_the_least_recently_used_idle_adapter(kit):
    """Three adapters known, two slots: a request on the third reads it back in, in the
    place of the one used longest ago that no request holds."""
    from tokenmill.engine.types import EngineBusy
    from tokenmill.model.loader import load_model

    _, base_dir, _, adapters = kit
    engine = _engine(load_model(str(base_dir), "float32"), {k: adapters[k] for k in ("a1", "a2")}, max_loras=2)
    engine.load_adapter("a3", str(adapters["a3"][0]))  # a1, the least recently used, leaves memory
    resident = {a["name"]: a["resident"] for a in engine.adapters.listing()}
    assert resident == {"a1": False, "a2": True, "a3": True}
    _run(engine, {"r1": (_ids(6, seed=1), "a1")})  # read back in, in a2's place
    assert {a["name"]: a["resident"] for a in engine.adapters.listing()} == {"a1": True, "a2": False, "a3": True}
    engine.add_request("h1", _ids(5, seed=2), SamplingParams(max_tokens=50, ignore_eos=True), lora="a1")
    engine.add_request("h3", _ids(5, seed=3), SamplingParams(max_tokens=50, ignore_eos=True), lora="a3")
    with pytest.raises(EngineBusy, match="slots"):  # both slots held by requests in flight
        engine.add_request("h2", _ids(5, seed=4), SamplingParams(max_tokens=5), lora="a2")
    engine.abort("h1")
    engine.add_request("h2", _ids(5, seed=4), SamplingParams(max_tokens=5), lora="a2")  # a1 made room
    while engine.has_unfinished():
        engine.step()
