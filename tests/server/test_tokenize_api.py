"""/tokenize and /detokenize (vLLM's shapes) against transformers' tokenizer of the same
GGUF file: a prompt, chat messages through the chat template, and back."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import MODEL

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime, café ☕."}]


def chat_ids(tok, messages, add_generation_prompt=True) -> list[int]:
    return list(tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt,
                                        return_dict=True)["input_ids"])


def post(server, path, body):
    # json.dumps writes a lone surrogate as \ud800, as a client may
    return httpx.post(server.url + path, content=json.dumps(body), headers={"content-type": "application/json"},
                      timeout=60)


def test_tokenize_prompt_matches_transformers(server, hf_tokenizer):
    text = "Hello world, naïve café ☕ 12345"
    r = post(server, "/tokenize", {"model": MODEL, "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    want = hf_tokenizer(text).input_ids
    assert body["tokens"] == want and body["count"] == len(want)
    assert body["max_model_len"] == httpx.get(server.url + "/v1/models").json()["data"][0]["max_model_len"]
    assert body["token_strs"] == [hf_tokenizer.decode([t]) for t in want]
    plain = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == hf_tokenizer(text, add_special_tokens=False).input_ids and plain["token_strs"] is None


def test_tokenize_messages_is_the_chat_prompt(server, hf_tokenizer):
    r = post(server, "/tokenize", {"model": MODEL, "messages": MESSAGES})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == chat_ids(hf_tokenizer, MESSAGES)
    # exactly what a chat completion is charged for
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                      json={"model": MODEL, "messages": MESSAGES, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == r.json()["count"]
    closed = post(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert closed["tokens"] == chat_ids(hf_tokenizer, MESSAGES, add_generation_prompt=False)


def test_detokenize_round_trip(server, hf_tokenizer):
    ids = post(server, "/tokenize", {"messages": MESSAGES}).json()["tokens"]
    r = post(server, "/detokenize", {"model": MODEL, "tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": hf_tokenizer.decode(ids)}
    assert post(server, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("path,body,param", [
    ("/detokenize", {"tokens": [1, 49152]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, "tokens"),
    ("/detokenize", {}, "tokens"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"),
    ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}] * 2049}, "messages"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
])
def test_bad_input_is_a_400(server, path, body, param):
    r = post(server, path, body)
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"], err


def test_body_limit_holds(server):
    r = httpx.post(server.url + "/tokenize", content=b'{"prompt": "' + b"a" * (9 << 20) + b'"}',
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413
