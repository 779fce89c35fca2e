"""LoRA adapters through the server (tokenmill/server/lora_routes.py): --lora at start,
vLLM's load/unload routes while other requests stream, /v1/models, keys limited to an
adapter, bad adapters refused with nothing changed. The adapters are PEFT-format folders
for the embedded SmolLM2 (its shapes), written here with random weights."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest
import torch
from safetensors.torch import save_file

from tests.server.conftest import MODEL, ServerProcess, add_key, metric

pytestmark = pytest.mark.slow

HIDDEN, KV, LAYERS = 576, 192, 30  # SmolLM2-135M: 9 heads and 3 KV heads of 64


def write_adapter(folder, seed: int, rank: int = 8, modules=("q_proj", "v_proj")) -> str:
    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    out = {"q_proj": HIDDEN, "v_proj": KV}
    tensors = {}
    for i in range(LAYERS):
        for m in modules:
            key = f"base_model.model.model.layers.{i}.self_attn.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, HIDDEN, generator=g) * 0.05
            tensors[f"{key}.lora_B.weight"] = torch.randn(out[m], rank, generator=g) * 0.05
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(modules)}))
    return str(folder)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: write_adapter(root / name, seed) for name, seed in (("a1", 1), ("a2", 2), ("big", 3))}


@pytest.fixture(scope="module")
def served(adapters):
    # the model priced at a provider's card, a1 at one of its own; a2 (loaded later) takes its base's
    srv = ServerProcess("--lora", f"a1={adapters['a1']}", "--max-loras", "2", "--max-lora-rank", "16",
                        "--model-price-card", f"{MODEL}=gpt-5.6-sol",
                        "--model-price-card", "a1=tokenmill-default").wait_ready()
    yield srv
    srv.stop()


def _answer(client, model: str) -> tuple[str, str]:
    r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=12, temperature=0)
    return r.model, r.choices[0].text


def test_adapters_answer_by_name_and_are_listed(served):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {MODEL, "a1"} and models["a1"].parent == MODEL and models[MODEL].parent is None
    base, tuned = _answer(client, MODEL), _answer(client, "a1")
    assert base[0] == MODEL and tuned[0] == "a1" and base[1] != tuned[1]
    assert _answer(client, "a1") == tuned  # greedy: the same answer again (now from the prefix cache)
    assert metric(served, 'tokenmill_model_generation_tokens_total{model="a1"}') >= 24


def test_load_and_unload_while_another_request_streams(served, adapters):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)
    streamed: list[str] = []

    def stream():
        for chunk in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count."}],
                                                    max_tokens=200, temperature=0, stream=True,
                                                    extra_body={"ignore_eos": True}):
            streamed.extend(c.delta.content or "" for c in chunk.choices)

    t = threading.Thread(target=stream)
    t.start()
    r = httpx.post(served.url + "/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": adapters["a2"]},
                   timeout=60)
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["rank"] == 8 and info["modules"] == ["q_proj", "v_proj"] and info["nbytes"] > 0
    model, text = _answer(client, "a2")
    assert model == "a2" and text != _answer(client, "a1")[1]
    assert httpx.post(served.url + "/v1/unload_lora_adapter", json={"lora_name": "a2"}, timeout=60).status_code == 200
    with pytest.raises(openai.NotFoundError):
        _answer(client, "a2")
    t.join(timeout=120)
    assert not t.is_alive() and len("".join(streamed)) > 100  # the stream ran through it all
    assert "a2" not in {m.id for m in client.models.list().data}


def test_each_model_and_adapter_is_priced_at_its_own_card(served, adapters):
    """--model-price-card: usage.cost names the card of what answered (an adapter without
    a card of its own: its base model's), and /v1/stats adds spend up by model."""
    from tokenmill.cost import load_cards, price

    cards = load_cards()

    def cost(model: str) -> dict:
        r = httpx.post(served.url + "/v1/completions", json={"model": model, "prompt": f"Price {model}:",
                                                             "max_tokens": 5, "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["usage"]

    before = {m["model"]: m for m in httpx.get(served.url + "/v1/stats").json()["totals"]["models"]}
    spent: dict[str, float] = {}
    assert httpx.post(served.url + "/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": adapters["a2"]},
                      timeout=60).status_code == 200
    try:
        for model, card in ((MODEL, "gpt-5.6-sol"), ("a1", "tokenmill-default"), ("a2", "gpt-5.6-sol")):
            usage = cost(model)
            assert usage["cost"]["card"] == card, (model, usage)
            want = price(cards[card], input_tokens=usage["prompt_tokens"],
                         cached_tokens=usage["prompt_tokens_details"]["cached_tokens"],
                         output_tokens=usage["completion_tokens"])
            assert usage["cost"]["total_usd"] == pytest.approx(float(want.total_usd))
            spent[model] = usage["cost"]["total_usd"]
    finally:
        httpx.post(served.url + "/v1/unload_lora_adapter", json={"lora_name": "a2"}, timeout=60)
    rows = {m["model"]: m for m in httpx.get(served.url + "/v1/stats").json()["totals"]["models"]}
    for model, usd in spent.items():
        was = before.get(model, {"cost_usd": 0.0, "samples": 0})
        assert rows[model]["cost_usd"] - was["cost_usd"] == pytest.approx(usd)
        assert rows[model]["samples"] - was["samples"] == 1


def test_bad_adapters_are_refused_and_change_nothing(served, adapters, tmp_path):
    before = httpx.get(served.url + "/v1/models").json()
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text("{not json")
    (bad / "adapter_model.safetensors").write_bytes(b"\0" * 32)
    wide = write_adapter(tmp_path / "wide", 4, rank=32)  # over --max-lora-rank 16
    cases = [({"lora_name": "x", "lora_path": str(bad)}, 400, "not a LoRA adapter config"),
             ({"lora_name": "x", "lora_path": wide}, 400, "above --max-lora-rank"),
             ({"lora_name": "x", "lora_path": str(tmp_path / "none")}, 400, "does not exist"),
             ({"lora_name": "a1", "lora_path": adapters["a2"]}, 400, "taken"),
             ({"lora_name": MODEL, "lora_path": adapters["a2"]}, 400, "taken"),
             ({"lora_name": "x"}, 400, "lora_path")]
    for body, status, text in cases:
        r = httpx.post(served.url + "/v1/load_lora_adapter", json=body, timeout=60)
        assert r.status_code == status and text in r.text, (body, r.text)
    r = httpx.post(served.url + "/v1/unload_lora_adapter", json={"lora_name": "never"})
    assert r.status_code == 404
    assert httpx.get(served.url + "/v1/models").json() == before
    assert httpx.get(served.url + "/health").json()["status"] == "ok"


def test_keys_limit_adapters_and_only_admins_load(adapters, tmp_path):
    db = tmp_path / "keys.db"
    admin = add_key(db, "ops", "--admin")
    limited = add_key(db, "team", "--models", "a1")
    srv = ServerProcess("--keys-db", str(db), "--lora", f"a1={adapters['a1']}", "--lora",
                        f"a2={adapters['a2']}").wait_ready()
    try:
        team = openai.OpenAI(base_url=srv.url + "/v1", api_key=limited, max_retries=0)
        assert _answer(team, "a1")[0] == "a1"
        for other in ("a2", MODEL):  # the same 404 as for a model that does not exist
            with pytest.raises(openai.NotFoundError):
                _answer(team, other)
        body = {"lora_name": "big", "lora_path": adapters["big"]}
        r = httpx.post(srv.url + "/v1/load_lora_adapter", json=body, headers={"Authorization": f"Bearer {limited}"})
        assert r.status_code == 403
        r = httpx.post(srv.url + "/v1/load_lora_adapter", json=body, headers={"Authorization": f"Bearer {admin}"},
                       timeout=60)
        assert r.status_code == 200, r.text
    finally:
        srv.stop()


def test_bad_lora_flags_are_refused_at_start(tmp_path, adapters):
    import subprocess
    import sys

    for args, text in ((["--lora", "a1"], "NAME=PATH"), (["--lora", f"a={tmp_path / 'no'}"], "does not exist"),
                       (["--lora", f"a={adapters['a1']}", "--lora", f"a={adapters['a2']}"], "twice"),
                       (["--model-price-card", "nobody=tokenmill-default"], "no model or adapter named 'nobody'"),
                       (["--model-price-card", f"{MODEL}=no-such-card"], "unknown rate card"),
                       (["--model-price-card", MODEL], "NAME=CARD")):
        r = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", "--port", "1", *args],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and text in r.stderr + r.stdout, (args, r.stderr)
