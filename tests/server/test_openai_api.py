"""The server as the official openai SDK sees it."""

from __future__ import annotations

import asyncio
import math
import time

import httpx
import pytest

from tests.server.conftest import MODEL, metric

Q = [{"role": "user", "content": "What is the capital of France?"}]


def test_models(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL]


def test_chat_non_streaming(client):
    r = client.chat.completions.create(model=MODEL, messages=Q, max_tokens=16, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    c = r.choices[0]
    assert c.message.role == "assistant" and "Paris" in c.message.content
    assert c.finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens > 20 and 0 < u.completion_tokens <= 16
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens >= 0


def _chat_stream_text(client, **kw):
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, **kw))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    return text, chunks


def test_chat_streaming_equals_non_streaming(client):
    kw = dict(messages=[{"role": "user", "content": "Write two sentences about whales."}], max_tokens=40,
              temperature=0)
    full = client.chat.completions.create(model=MODEL, **kw).choices[0].message.content
    text, chunks = _chat_stream_text(client, stream_options={"include_usage": True}, **kw)
    assert text == full
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finishes) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert all(ch.usage is None for ch in chunks[:-1])


def test_completions_streaming_equals_non_streaming(client):
    kw = dict(prompt="Once upon a time, in a small village,", max_tokens=30, temperature=0)
    full = client.completions.create(model=MODEL, **kw)
    assert full.object == "text_completion"
    parts = list(client.completions.create(model=MODEL, stream=True, **kw))
    assert "".join(p.choices[0].text for p in parts if p.choices) == full.choices[0].text


def test_max_tokens_and_max_completion_tokens(client):
    for key in ("max_tokens", "max_completion_tokens"):
        r = client.chat.completions.create(model=MODEL, messages=Q, temperature=0, extra_body={"ignore_eos": True},
                                           **{key: 7})
        assert r.usage.completion_tokens == 7 and r.choices[0].finish_reason == "length"


def test_seed_makes_sampling_reproducible(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=24,
              temperature=1.0, top_p=0.95, seed=42)
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    c = client.chat.completions.create(**{**kw, "seed": 7}).choices[0].message.content
    assert a == b and a != c


def test_n_choices(client):
    r = client.chat.completions.create(model=MODEL, messages=Q, n=3, max_tokens=12, temperature=1.0, seed=1)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) > 1
    assert r.usage.completion_tokens == 3 * 12 or r.usage.completion_tokens > 12
    text, chunks = _chat_stream_text(client, messages=Q, n=2, max_tokens=5, temperature=0)
    assert {ch.choices[0].index for ch in chunks if ch.choices} == {0, 1}


def test_stop(client):
    r = client.chat.completions.create(model=MODEL, messages=Q, max_tokens=16, temperature=0, stop=["Paris"])
    assert r.choices[0].finish_reason == "stop" and "Paris" not in r.choices[0].message.content
    assert r.choices[0].message.content.startswith("The capital of France is")


def test_penalties_accepted(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "List animals."}], max_tokens=40, temperature=0)
    base = client.chat.completions.create(**kw).choices[0].message.content
    pen = client.chat.completions.create(presence_penalty=2.0, frequency_penalty=2.0, **kw).choices[0].message.content
    rep = client.chat.completions.create(extra_body={"repetition_penalty": 1.5}, **kw).choices[0].message.content
    assert pen != base and rep != base


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=Q, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert item.top_logprobs[0].token == item.token  # greedy picks the top token
        assert math.isclose(item.top_logprobs[0].logprob, item.logprob, abs_tol=1e-6)
        assert bytes(item.bytes).decode("utf-8", "replace") == item.token or item.bytes


def test_completions_logprobs_and_echo(client):
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True)
    c = r.choices[0]
    assert c.text.startswith(prompt)
    lp = c.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(lp.tokens) == r.usage.prompt_tokens + r.usage.completion_tokens
    assert "".join(lp.tokens) == c.text
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset)


def test_extension_fields(client):
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=10, temperature=0.8, seed=3, user="u1",
                                  extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1,
                                              "ignore_eos": True, "cache_salt": "abc"})
    assert r.usage.completion_tokens == 10


def test_cached_tokens_reported(client):
    long = [{"role": "system", "content": "You are a helpful assistant. " * 30}, *Q]
    client.chat.completions.create(model=MODEL, messages=long, max_tokens=2, temperature=0)
    r = client.chat.completions.create(model=MODEL, messages=long, max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens >= (r.usage.prompt_tokens // 16 - 1) * 16 > 0


@pytest.mark.parametrize("stream", [False, True])
def test_cached_tokens_counted_once_per_prompt(client, stream):
    """Each engine update repeats the prompt's cached count: summing them once over-counted
    cached tokens (past the prompt itself) and failed pricing mid-stream."""
    prompt = f"Cache accounting, streamed={stream}. " + "The quick brown fox jumps over the lazy dog. " * 8
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    kw = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    r = client.completions.create(model=MODEL, prompt=[prompt, prompt], max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True}, **kw)
    usage = [c.usage for c in r if c.usage][-1] if stream else r.usage
    per_prompt = usage.prompt_tokens // 2
    assert usage.prompt_tokens_details.cached_tokens == 2 * ((per_prompt - 1) // 16) * 16
    assert usage.completion_tokens == 16


@pytest.mark.slow
def test_32_concurrent_requests(client, aclient):
    prompts = [f"Count from {i} to {i + 5}:" for i in range(32)]
    sequential = {p: client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0).choices[0].text
                  for p in prompts[:4]}

    async def one(p, stream):
        if stream:
            s = await aclient.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0, stream=True)
            return "".join([c.choices[0].text async for c in s if c.choices])
        r = await aclient.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0)
        return r.choices[0].text

    async def main():
        return await asyncio.gather(*[one(p, i % 2 == 0) for i, p in enumerate(prompts)])

    out = asyncio.run(main())
    assert len(out) == 32 and all(isinstance(t, str) and t for t in out)
    for p, t in zip(prompts, out):
        if p in sequential:
            assert t == sequential[p]


def test_cancel_mid_stream_frees_everything(server, client):
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Write a long essay."}],
                                            max_tokens=2000, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    got = 0
    for ch in stream:
        got += 1
        if got >= 5:
            break
    stream.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if metric(server, "tokenmill_num_requests_running") == 0 and metric(server, "tokenmill_kv_blocks_used") == 0:
            break
        time.sleep(0.2)
    assert metric(server, "tokenmill_num_requests_running") == 0
    assert metric(server, "tokenmill_kv_blocks_used") == 0
    assert metric(server, "tokenmill_num_requests_waiting") == 0


def test_metrics_exposed(server, client):
    client.chat.completions.create(model=MODEL, messages=Q, max_tokens=3, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    for name in ("tokenmill_time_to_first_token_seconds_bucket", "tokenmill_inter_token_latency_seconds_bucket",
                 "tokenmill_e2e_request_latency_seconds_bucket", "tokenmill_request_queue_time_seconds_bucket",
                 "tokenmill_request_prompt_tokens_bucket", "tokenmill_request_generation_tokens_bucket",
                 "tokenmill_num_requests_running", "tokenmill_num_requests_waiting", "tokenmill_kv_blocks_used",
                 "tokenmill_kv_blocks_total", "tokenmill_prompt_tokens_total", "tokenmill_cached_prompt_tokens_total",
                 "tokenmill_generation_tokens_total", 'tokenmill_requests_total{finish_reason="stop"}',
                 'tokenmill_http_responses_total{status_code="200"}'):
        assert name in text, name
    assert metric(server, "tokenmill_kv_blocks_total") > 0
