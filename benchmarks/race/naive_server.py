"""The naive baseline for `benchmarks/compare`: transformers `generate()`, one request at
a time, behind a minimal OpenAI-style HTTP shim (measured over HTTP like every peer).

    python -m benchmarks.race.naive_server --model FILE.gguf --port 8123 --threads 2

Serves GET /v1/models, GET /ready and streaming or plain POST /v1/completions (and a
/v1/chat/completions that applies the GGUF's chat template). A lock serializes
generation: no batching, no paged KV, no prefix cache: what "just call generate()"
gives. Each generated token is streamed as its own SSE chunk (a streamer that receives
token ids and decodes incrementally); `ignore_eos` is honored with min_new_tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
import time
import uuid
from typing import Any, AsyncIterator, Optional

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer


class TokenQueue(BaseStreamer):
    """Receives token ids from generate() (in its thread) and hands them to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: "asyncio.Queue[Optional[int]]") -> None:
        self.loop, self.queue, self.prompt_seen = loop, queue, False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate() first passes the prompt
            self.prompt_seen = True
            return
        for tok in value.reshape(-1).tolist():
            self.loop.call_soon_threadsafe(self.queue.put_nowait, int(tok))

    def end(self) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)


class Naive:
    """The model, its tokenizer and the one-at-a-time lock."""

    def __init__(self, path: str) -> None:
        folder, name = os.path.split(os.path.abspath(path))
        self.tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        self.model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
        self.model_id = name
        self.lock = asyncio.Lock()

    async def stream(self, ids: list[int], max_tokens: int, ignore_eos: bool) -> AsyncIterator[int]:
        async with self.lock:
            loop = asyncio.get_running_loop()
            queue: asyncio.Queue[Optional[int]] = asyncio.Queue()
            kwargs: dict[str, Any] = dict(
                input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=max_tokens, do_sample=False, streamer=TokenQueue(loop, queue),
                pad_token_id=self.tok.pad_token_id or self.tok.eos_token_id)
            if ignore_eos:
                kwargs["min_new_tokens"] = max_tokens

            def run() -> None:
                with torch.inference_mode():
                    self.model.generate(**kwargs)

            worker = threading.Thread(target=run, daemon=True)
            worker.start()
            while (tok := await queue.get()) is not None:
                yield tok
            worker.join()


def make_app(naive: Naive) -> FastAPI:
    app = FastAPI()

    @app.get("/ready")
    async def ready() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": naive.model_id, "object": "model"}]}

    async def complete(req: Request, chat: bool) -> Any:
        body = await req.json()
        if chat:
            text = naive.tok.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
            ids = naive.tok(text, add_special_tokens=False)["input_ids"]
        else:
            ids = naive.tok(body["prompt"])["input_ids"]
        max_tokens = int(body.get("max_tokens") or 16)
        ignore_eos = bool(body.get("ignore_eos", False))
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str, finish: Optional[str]) -> dict[str, Any]:
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
            choice |= {"delta": {"content": text}} if chat else {"text": text}
            return {"id": rid, "object": kind, "created": created, "model": naive.model_id, "choices": [choice]}

        async def events() -> AsyncIterator[str]:
            out: list[int] = []
            sent = ""
            async for tok in naive.stream(ids, max_tokens, ignore_eos):
                out.append(tok)
                text = naive.tok.decode(out, skip_special_tokens=True)
                if text.endswith("\ufffd"):
                    continue  # an incomplete UTF-8 sequence: wait for the next token
                delta, sent = text[len(sent):], text
                yield f"data: {json.dumps(chunk(delta, None))}\n\n"
            finish = "length" if len(out) >= max_tokens else "stop"
            yield f"data: {json.dumps(chunk('', finish))}\n\n"
            usage = {"prompt_tokens": len(ids), "completion_tokens": len(out),
                     "total_tokens": len(ids) + len(out)}
            if (body.get("stream_options") or {}).get("include_usage"):
                yield f"data: {json.dumps({'id': rid, 'object': kind, 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        if body.get("stream"):
            return StreamingResponse(events(), media_type="text/event-stream")
        out = [tok async for tok in naive.stream(ids, max_tokens, ignore_eos)]
        text = naive.tok.decode(out, skip_special_tokens=True)
        return JSONResponse({"id": rid, "object": "text_completion", "model": naive.model_id,
                             "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                             "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out),
                                       "total_tokens": len(ids) + len(out)}})

    @app.post("/v1/completions")
    async def completions(req: Request) -> Any:
        return await complete(req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: Request) -> Any:
        return await complete(req, chat=True)

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    uvicorn.run(make_app(Naive(args.model)), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
