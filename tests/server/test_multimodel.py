"""Several models in one server (tokenmill/engine/models.py), through the official openai
SDK: the embedded model and a tiny random Llama folder made here (with the embedded
model's tokenizer), each answering by name; swaps under a memory budget that fits one
of them; keep_alive; a corrupt model whose load fails; the operator's load and unload."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time

import httpx
import pytest
import torch

from tests.server.conftest import MODEL, ServerProcess, add_key

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")

TINY = "tiny-llama"
BROKEN = "broken-llama"
PROMPT = [1, 504, 3458, 282, 4649, 314]  # token ids: both models share the embedded tokenizer
KV_GB = 0.05


def make_tiny(folder, seed: int = 0) -> torch.nn.Module:
    """A random 2-layer Llama over the embedded model's vocabulary (its weights drawn from
    `seed`), saved with its tokenizer and chat template, so that the server can serve it
    by text."""
    from tokenmill.model.metadata import load_model_info

    tok = load_model_info(None).tokenizer
    os.makedirs(folder, exist_ok=True)
    tok.hf.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": tok.chat_template.source, "eos_token": tok.hf.id_to_token(tok.eos_token_ids[0]),
                   "bos_token": tok.hf.id_to_token(tok.bos_token_id)}, f)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=tok.vocab_size, max_position_embeddings=512,
                                   tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                                   eos_token_id=tok.eos_token_ids[0])
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return model


def greedy(model, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


def estimate(path: str) -> int:
    from tokenmill.engine.model_memory import weights_bytes

    return weights_bytes(path) + int(KV_GB * 1024 ** 3)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    folder = str(root / TINY)
    return folder, make_tiny(folder)


@pytest.fixture(scope="module")
def server(tiny, embedded_path, tmp_path_factory):
    """The embedded model and the tiny one, and a copy of the tiny one whose weights are cut
    short; a memory budget that holds the embedded model, but never it beside another."""
    folder, _ = tiny
    broken = str(tmp_path_factory.mktemp("broken") / BROKEN)
    shutil.copytree(folder, broken)
    weights = os.path.join(broken, "model.safetensors")
    with open(weights, "r+b") as f:  # its header intact, its tensors cut short: fails at load, not before
        f.truncate(os.path.getsize(weights) // 2)
    budget = (estimate(embedded_path) + estimate(folder) // 2) / 1024 ** 3
    srv = ServerProcess("--model", embedded_path, "--model", folder, "--model", broken, "--kv-cache-gb", str(KV_GB),
                        "--memory-budget", f"{budget:.6f}", "--dtype", "float32", "--keep-alive", "1m",
                        "--model-queue", "4", "--max-num-seqs", "8").wait_ready()
    yield srv
    srv.stop()


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture()
def aclient(server):
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def states(server) -> dict[str, dict]:
    return {m["id"]: m for m in httpx.get(server.url + "/v1/models", timeout=10).json()["data"]}


def wait_state(server, model: str, state: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = states(server)[model]
        if row["state"] == state:
            return row
        time.sleep(0.1)
    raise AssertionError(f"{model} never became {state}: {states(server)[model]}")


def complete(client, model: str, **kw) -> str:
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True, **kw.pop("extra_body", {})}, **kw)
    assert r.model == model
    return r.choices[0].text


def test_keep_alive_values_as_ollama_takes_them():
    from tokenmill.server.limits import parse_keep_alive

    assert [parse_keep_alive(v) for v in (0, 30, 2.5, "90", "5m", "1h30m", "250ms")] == [0, 30, 2.5, 90, 300, 5400,
                                                                                      0.25]
    assert parse_keep_alive(-1) == parse_keep_alive("-1") == parse_keep_alive("-5m") == float("inf")
    for bad in ("soon", "", "5d", True, None, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            parse_keep_alive(bad)


def test_models_dir_serves_its_gguf_files_and_folders(tmp_path, embedded_path):
    from tokenmill.server.options import ServeOptions

    folder = tmp_path / "b-folder"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("not a model")
    (tmp_path / "empty").mkdir()
    paths = [c.model.path for c in ServeOptions(models_dir=str(tmp_path)).engine_configs()]
    assert paths == [str(tmp_path / "a.gguf"), str(folder)]
    paths = [c.model.path for c in ServeOptions(model=[str(folder), embedded_path],
                                                models_dir=str(tmp_path)).engine_configs()]
    assert paths == [str(folder), embedded_path, str(tmp_path / "a.gguf")]  # each once, the --model ones first
    with pytest.raises(ValueError, match="holds no model"):
        ServeOptions(models_dir=str(tmp_path / "empty")).engine_configs()


def test_lazy_start_and_each_model_answers_by_name(server, client, tiny):
    listed = [m.id for m in client.models.list().data]
    assert listed == [MODEL, TINY, BROKEN]  # the first --model is the default, first
    assert {s["state"] for s in states(server).values()} == {"available"}  # nothing loads before its request
    from tokenmill.model.metadata import load_model_info

    folder, ref = tiny
    ref_text = load_model_info(folder).tokenizer.decode(greedy(ref, PROMPT, 8), skip_special_tokens=False)
    assert complete(client, TINY) == ref_text  # the tiny model, as transformers runs it on the same weights
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is the capital "
                                                                                               "of France?"}],
                                          max_tokens=12, temperature=0)
    assert chat.model == MODEL and "Paris" in chat.choices[0].message.content
    assert complete(client, MODEL) != ref_text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=1)


def test_swaps_under_a_budget_that_fits_one(server, client, aclient):
    """Requests alternating between the two models, all at once: every one answered, by
    its own model (the exact mode's answers do not depend on batching), with swaps."""
    want = {m: complete(client, m) for m in (MODEL, TINY)}
    row = states(server)
    assert [m for m, r in row.items() if r["state"] == "loaded"] == [TINY]  # the budget holds one
    loads = {m: row[m]["loads"] for m in (MODEL, TINY)}

    async def run() -> list[tuple[str, str]]:
        async def one(i: int) -> tuple[str, str]:
            model = (MODEL, TINY)[i % 2]
            r = await aclient.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                                 extra_body={"ignore_eos": True})
            assert r.model == model
            return model, r.choices[0].text

        answers = []
        for wave in range(2):  # one wave at a time: each wave needs both models, so a swap each
            answers += await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(4))), 120)
        return answers

    answers = asyncio.run(run())
    assert len(answers) == 8 and all(text == want[model] for model, text in answers)
    row = states(server)
    assert sum(row[m]["loads"] - loads[m] for m in (MODEL, TINY)) >= 2
    assert sum(r["state"] == "loaded" for r in row.values()) <= 1


def test_keep_alive_zero_unloads_and_minus_one_pins(server, client):
    complete(client, TINY, extra_body={"keep_alive": 0})
    wait_state(server, TINY, "available", 10)
    complete(client, TINY, extra_body={"keep_alive": "-1"})
    row = states(server)[TINY]
    assert row["state"] == "loaded" and row["keep_alive"] == -1 and row["expires_in"] is None
    # pinned: the other model cannot make room, and says so at once
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    assert e.value.status_code == 503 and "pinned" in str(e.value) and e.value.body["code"] == "model_too_large"
    with pytest.raises(openai.BadRequestError):
        complete(client, TINY, extra_body={"keep_alive": "soon"})
    r = httpx.post(f"{server.url}/v1/models/{TINY}/unload", timeout=30)
    assert r.status_code == 200 and r.json()["state"] == "available"
    assert complete(client, MODEL)


def test_a_corrupt_model_fails_its_waiting_requests_and_others_serve(server, client, aclient):
    async def run():
        calls = [aclient.completions.create(model=BROKEN, prompt=PROMPT, max_tokens=4) for _ in range(3)]
        return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 60)

    results = asyncio.run(run())
    assert all(isinstance(r, openai.InternalServerError) for r in results), results
    assert all(r.status_code == 503 and r.body["code"] == "model_load_failed" and BROKEN in str(r) for r in results)
    row = states(server)[BROKEN]
    assert row["state"] == "available" and "failed to load" in row["error"]
    assert complete(client, MODEL)  # the others serve on


def test_loading_queue_is_bounded(server, aclient):
    """--model-queue 4: a fifth request waiting for the same load is refused with 503 and
    Retry-After; the four answered. Nothing hangs."""
    httpx.post(f"{server.url}/v1/models/{MODEL}/unload", timeout=30)
    httpx.post(f"{server.url}/v1/models/{TINY}/unload", timeout=30)

    async def run():
        calls = [aclient.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2) for _ in range(8)]
        return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 120)

    results = asyncio.run(run())
    refused = [r for r in results if isinstance(r, Exception)]
    assert 4 <= len(results) - len(refused) and refused, results
    for r in refused:
        assert isinstance(r, openai.InternalServerError) and r.body["code"] == "model_queue_full"
        assert r.response.headers["retry-after"] == "1"


def test_operator_load_unload_and_metrics(server):
    r = httpx.post(f"{server.url}/v1/models/{TINY}/load", json={"keep_alive": "10m"}, timeout=60)
    assert r.status_code == 200, r.text
    row = r.json()
    assert row["state"] == "loaded" and row["keep_alive"] == 600 and row["memory"]["rss_bytes"] > 0
    assert httpx.post(f"{server.url}/v1/models/nope/load", timeout=10).status_code == 404
    body = httpx.get(server.url + "/v1/models", timeout=10).json()
    assert body["memory_budget_bytes"] > 0
    text = httpx.get(server.url + "/metrics", timeout=10).text
    assert f'tokenmill_model_loaded{{model="{TINY}"}} 1.0' in text
    assert f'tokenmill_model_requests_total{{model="{TINY}"}}' in text
    r = httpx.post(f"{server.url}/v1/models/{TINY}/unload", timeout=60)
    assert r.json()["state"] == "available"


@pytest.mark.slow
def test_preload_and_load_and_unload_need_an_admin_key(tiny, tmp_path):
    db = tmp_path / "keys.db"
    user, admin = add_key(db, "acme"), add_key(db, "ops", "--admin")
    folder, _ = tiny
    srv = ServerProcess("--model", folder, "--models-dir", os.path.dirname(folder), "--keys-db", str(db),
                        "--kv-cache-gb", str(KV_GB), "--preload").wait_ready()
    try:
        rows = httpx.get(srv.url + "/v1/models", headers={"authorization": f"Bearer {user}"}, timeout=10).json()
        assert [m["id"] for m in rows["data"]] == [TINY]  # --models-dir adds no twin of a --model
        assert rows["data"][0]["state"] == "loaded"  # --preload: loaded before the first request
        url = f"{srv.url}/v1/models/{TINY}/unload"
        assert httpx.post(url, timeout=30).status_code == 401
        r = httpx.post(url, headers={"authorization": f"Bearer {user}"}, timeout=30)
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
        r = httpx.post(url, headers={"authorization": f"Bearer {admin}"}, timeout=60)
        assert r.status_code == 200 and r.json()["state"] == "available"
    finally:
        srv.stop()
