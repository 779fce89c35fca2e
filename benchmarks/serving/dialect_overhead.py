"""What a dialect costs over /v1/chat/completions on single-stream decode.

One server; the same greedy request (same prompt, same max tokens, so the same tokens)
streamed through /v1/chat/completions, /v1/messages and /v1/responses in rotating
rounds; per route the median decode rate (output tokens after the first / time from the
first text to the last) and TTFT at the client, and the engine's own decode rate (its
inter-token latency histogram) for the same requests. Then, in-process, the translation alone: microseconds
per streamed chunk to turn chat chunks into each dialect's events, against serializing
the chat chunk itself.

    .venv/bin/python -m benchmarks.serving.dialect_overhead [--rounds 8 --max-tokens 128 --dtype bfloat16 --quantization int4] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx

from benchmarks.servers import ROOT, RunningServer, ServerSpec, serve_cmd

MODEL = "SmolLM2-135M-Instruct"

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def bodies(max_tokens: int) -> dict[str, dict]:
    msgs = [{"role": "user", "content": PROMPT}]
    return {
        "/v1/chat/completions": {"model": MODEL, "messages": msgs, "max_tokens": max_tokens, "temperature": 0,
                                 "stream": True, "stream_options": {"include_usage": True}},
        "/v1/messages": {"model": MODEL, "messages": msgs, "max_tokens": max_tokens, "temperature": 0,
                         "stream": True},
        "/v1/responses": {"model": MODEL, "input": PROMPT, "max_output_tokens": max_tokens, "temperature": 0,
                          "stream": True, "store": False},
    }


def _text_and_usage(path: str, data: dict) -> tuple[bool, int | None]:
    """(this event carries output text, the output token count if it carries the usage)."""
    if path == "/v1/chat/completions":
        has_text = bool(data["choices"] and data["choices"][0]["delta"].get("content"))
        return has_text, (data.get("usage") or {}).get("completion_tokens")
    if path == "/v1/messages":
        return data["type"] == "content_block_delta", (data.get("usage") or {}).get("output_tokens") \
            if data["type"] == "message_delta" else None
    usage = data.get("response", {}).get("usage") if data["type"] in ("response.completed",
                                                                     "response.incomplete") else None
    return data["type"] == "response.output_text.delta", usage["output_tokens"] if usage else None


def _engine(url: str) -> dict[str, float]:
    """The engine's inter-token latency and TTFT histograms' sums and counts."""
    vals = {}
    for line in httpx.get(url + "/metrics", timeout=60).text.splitlines():
        for name in ("inter_token_latency", "time_to_first_token"):
            for key in ("sum", "count"):
                if line.startswith(f"tokenmill_{name}_seconds_{key} "):
                    vals[f"{name}_{key}"] = float(line.rsplit(" ", 1)[1])
    return vals


def stream_once(url: str, path: str, body: dict) -> tuple[float, float, int, float, float]:
    """(decode tokens/s at the client, TTFT ms at the client, output tokens, decode
    tokens/s in the engine, TTFT ms in the engine: arrival to first token)."""
    e0 = _engine(url)
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    with httpx.stream("POST", url + path, json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            has_text, n = _text_and_usage(path, json.loads(line[6:]))
            if has_text:
                last = time.perf_counter()
                first = first or last
            tokens = n if n is not None else tokens
    e1 = _engine(url)
    d = {k: e1[k] - e0[k] for k in e1}
    return ((tokens - 1) / (last - first), (first - t0) * 1000, tokens,
            d["inter_token_latency_count"] / d["inter_token_latency_sum"], d["time_to_first_token_sum"] * 1000)


def translation_cost(n: int = 20000) -> dict[str, float]:
    """Microseconds per chunk, in-process: chat chunks -> each dialect's events."""
    from tokenmill.server.dialects import anthropic, responses, responses_stream
    from tokenmill.server.serving import RequestContext, sse

    usage = {"prompt_tokens": 30, "completion_tokens": n, "total_tokens": 30 + n,
             "prompt_tokens_details": {"cached_tokens": 0}}
    base = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 0, "model": MODEL, "usage": None}
    chunks = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None, "stop_reason": None}]}]
    chunks += [{**base, "choices": [{"index": 0, "delta": {"content": " word"}, "logprobs": None,
                                     "finish_reason": None, "stop_reason": None}]} for _ in range(n)]
    chunks.append({**base, "choices": [], "usage": usage})

    async def feed():
        for c in chunks:
            yield c

    async def drain(gen) -> float:
        t = time.perf_counter()
        async for _ in gen:
            pass
        return (time.perf_counter() - t) / n * 1e6

    async def chat_sse():
        async for c in feed():
            yield sse(c)

    ctx = RequestContext(request_id="msg-x", usage=usage)
    msg_body = anthropic.MessagesRequest(model=MODEL, max_tokens=n, messages=[{"role": "user", "content": "x"}])
    resp_body = responses.ResponsesRequest(model=MODEL, input="x")

    async def done(output, status, chat_usage, incomplete=None, error=None):
        return responses.response_object("resp-x", resp_body, 0, status, stored=False, output=output,
                                         chat_usage=chat_usage)

    async def failed(output, error):
        return await done(output, "failed", None)

    async def run() -> dict[str, float]:
        start = responses.response_object("resp-x", resp_body, 0, "in_progress", stored=False)
        return {"chat (serialize only)": await drain(chat_sse()),
                "messages": await drain(anthropic.stream_events(feed(), msg_body, ctx)),
                "responses": await drain(responses_stream.stream_events(feed(), start, done, failed))}

    return asyncio.run(run())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default="int4")
    ap.add_argument("--quick", action="store_true", help="smoke run: one round of 16 tokens per route")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.max_tokens = 1, 16
    print("translation alone, us per chunk:", {k: round(v, 2) for k, v in translation_cost(2000 if args.quick else 20000).items()})
    spec = ServerSpec("tokenmill", serve_cmd("--dtype", args.dtype, "--quantization", args.quantization,
                                             "--no-batch-api", "--kv-cache-gb", "0.25"), "/ready")
    with RunningServer(spec, ROOT / "bench-results" / "dialect_overhead") as srv:
        routes = bodies(args.max_tokens)
        for path, body in routes.items():  # warm up each path once
            stream_once(srv.base_url, path, body)
        results: dict[str, list[tuple[float, float, int, float, float]]] = {p: [] for p in routes}
        order = list(routes)
        for i in range(args.rounds):  # the order rotates: no route always follows the same one
            for path in order[i % 3:] + order[:i % 3]:
                results[path].append(stream_once(srv.base_url, path, routes[path]))
    # The machine's load moves the engine's speed between requests far more than any
    # route could; each request's client figures against its own engine figures do not
    # move with it: that difference is the route's cost.
    med = statistics.median
    for path, rs in results.items():
        print(f"{path:24s} decode {med(r[0] for r in rs):6.2f} tok/s at the client, {med(r[3] for r in rs):6.2f} in "
              f"the engine (client/engine {(med(r[0] / r[3] for r in rs) - 1) * 100:+.2f}%); TTFT "
              f"{med(r[1] for r in rs):7.1f} ms at the client, {med(r[4] for r in rs):7.1f} ms in the engine "
              f"(+{med(r[1] - r[4] for r in rs):.1f} ms); tokens {sorted({r[2] for r in rs})}")


if __name__ == "__main__":
    main()
