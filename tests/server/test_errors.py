"""Error cases and headers, over raw HTTP."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import MODEL

OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _post(server, path, body=None, content=None, headers=None):
    return httpx.post(server.url + path, json=body, content=content, headers=headers, timeout=60)


def _err(r, status, param=None):
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"]
    if param is not None:
        assert e["param"] == param
    return e


@pytest.mark.parametrize("field,value", [
    ("temperature", -1), ("top_p", 0), ("top_p", 2), ("n", 0), ("max_tokens", 0), ("presence_penalty", 5),
    ("frequency_penalty", -3), ("top_logprobs", 99), ("min_p", 2), ("top_k", -5),
])
def test_invalid_values_are_400(server, field, value):
    body = {**OK_CHAT, field: value}
    if field == "top_logprobs":
        body["logprobs"] = True
    _err(_post(server, "/v1/chat/completions", body), 400, field)


@pytest.mark.parametrize("field,value", [
    ("temperature", "hot"), ("max_tokens", "many"), ("messages", "hello"), ("stream", "yes"), ("n", 1.5),
    ("stop", 5), ("model", 3),
    # booleans are not numbers (they were taken as 0 and 1)
    ("temperature", False), ("n", True), ("seed", False), ("top_k", False), ("min_tokens", True),
    ("stop_token_ids", [1, True]), ("logit_bias", {"5": True}),
])
def test_wrong_types_are_400(server, field, value):
    _err(_post(server, "/v1/chat/completions", {**OK_CHAT, field: value}), 400, field)


def test_malformed_json_is_400(server):
    for content in (b"{not json", b"", b"[1, 2]", b"null", b'"str"'):
        _err(_post(server, "/v1/chat/completions", content=content,
                   headers={"content-type": "application/json"}), 400)


def test_missing_fields_are_400(server):
    _err(_post(server, "/v1/chat/completions", {"model": MODEL}), 400, "messages")
    _err(_post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}), 400, "model")
    _err(_post(server, "/v1/chat/completions", {"model": MODEL, "messages": []}), 400, "messages")
    _err(_post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}),
         400)
    _err(_post(server, "/v1/completions", {"model": MODEL, "prompt": []}), 400, "prompt")
    _err(_post(server, "/v1/completions", {"model": MODEL, "prompt": [1, 2, 10 ** 9]}), 400, "prompt")


def test_unknown_model_is_404(server):
    e = _err(_post(server, "/v1/chat/completions", {**OK_CHAT, "model": "gpt-9"}), 404, "model")
    assert "gpt-9" in e["message"]


def test_too_long_is_400_naming_both_numbers(server):
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": "hello " * 100, "max_tokens": 8150})
    e = _err(r, 400)
    assert "8192" in e["message"] and "8150" in e["message"]
    prompt_tokens = len(httpx.post(server.url + "/v1/completions", json={
        "model": MODEL, "prompt": "hello " * 100, "max_tokens": 1}).json()["usage"]["prompt_tokens"] * "x")
    assert str(prompt_tokens) in e["message"]


def test_wrong_method_and_path(server):
    _err(httpx.get(server.url + "/v1/chat/completions"), 405)
    _err(httpx.post(server.url + "/v1/nothing", json={}), 404)


def test_request_id_header(server):
    r = _post(server, "/v1/chat/completions", OK_CHAT, headers={"x-request-id": "client-abc-123"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "client-abc-123"
    r = _post(server, "/v1/chat/completions", OK_CHAT)
    assert len(r.headers["x-request-id"]) >= 16
    r = _post(server, "/v1/chat/completions", {**OK_CHAT, "n": 0}, headers={"x-request-id": "bad-1"})
    assert r.status_code == 400 and r.headers["x-request-id"] == "bad-1"
    assert httpx.get(server.url + "/health").headers["x-request-id"]


def test_server_survives_bad_requests(server):
    for _ in range(3):
        _post(server, "/v1/chat/completions", content=b"\xff\xfe garbage", headers={"content-type": "application/json"})
    r = _post(server, "/v1/chat/completions", OK_CHAT)
    assert r.status_code == 200 and httpx.get(server.url + "/ready").status_code == 200


def test_lone_surrogates_are_400(server):
    # JSON may escape a lone surrogate, which is not Unicode text: the tokenizer refused it
    # with a TypeError, a 500, until the fuzz run (test_fuzz.py) found it
    for path, body, param in [
        ("/v1/completions", b'{"model": "%s", "prompt": "\\ud800 hi", "max_tokens": 1}', "prompt"),
        ("/v1/completions", b'{"model": "%s", "prompt": ["ok", "\\udfff"], "max_tokens": 1}', "prompt"),
        ("/v1/chat/completions",
         b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud83d"}], "max_tokens": 1}', "messages"),
        ("/v1/chat/completions",
         b'{"model": "%s", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}], '
         b'"max_tokens": 1}',
         "messages"),
    ]:
        _err(_post(server, path, content=body % MODEL.encode(), headers={"content-type": "application/json"}),
             400, param)
    assert _post(server, "/v1/chat/completions", OK_CHAT).status_code == 200
