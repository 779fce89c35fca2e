"""POST /v1/embeddings (OpenAI's shapes) and /v1/rerank (also /rerank: the Jina/Cohere
shape vLLM and llama-server serve), on whatever model is served: a decoder pools its
final hidden states (last token by default, mean on request: `pooling`), an encoder
(tokenmill/model/bert.py) as it was trained to.

Each input is one engine request with `SamplingParams.pooling` (resolved by the same
`prepare` as chat: the same bounds, the gate's admission and token reservation, pricing
as input tokens only, metrics and traces), so the engine batches them with everything
else. Vectors come back L2-normalized; `dimensions` truncates a Matryoshka-trained
model's vector and renormalizes it. Rerank scores are the cosine similarity of the
query's and each document's embeddings (no cross-encoder is installable from PyPI as a
wheel today): `/v1/models` says so.
"""

from __future__ import annotations

import base64
import math
import struct
from typing import Any, Literal, Union

from fastapi import FastAPI, Request
from pydantic import Field, StrictBool, StrictInt, StrictStr
from starlette.responses import Response

from tokenmill.engine.api import EmbeddingSpec, SamplingParams
from tokenmill.server.errors import APIError
from tokenmill.server.protocol import _Body
from tokenmill.server.serving import (BaseServing, RequestContext, json_response, merge_streams, now,
                                      run_until_disconnected)

RERANK_METHOD = "cosine similarity of the model's embeddings"


class _EmbeddingBody(_Body):
    model: StrictStr
    pooling: Literal["last", "mean", "cls"] | None = None  # a decoder's choice (None: the model's default)
    priority: Literal["interactive", "batch"] | None = None
    user: StrictStr | None = None

    @property
    def stream(self) -> bool:  # (the app's serve: only a stream skips idempotency)
        return False

    def trace_params(self) -> dict[str, Any]:
        return {}


class EmbeddingRequest(_EmbeddingBody):
    input: Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None


class RerankDocument(_Body):
    text: StrictStr


class RerankRequest(_EmbeddingBody):
    query: StrictStr
    documents: list[Union[StrictStr, RerankDocument]]
    top_n: StrictInt | None = Field(default=None, ge=1)
    return_documents: StrictBool = True


def unit(vec: list[float]) -> list[float]:
    norm = math.sqrt(sum(x * x for x in vec))
    return [x / norm for x in vec] if norm > 0 else vec


class ServingEmbedding(BaseServing):
    def _spec(self, body: _EmbeddingBody) -> tuple[EmbeddingSpec, str]:
        self.check_model(body.model)
        spec = self.engine.served(self.model_name).embedding
        if spec is None:
            raise APIError(400, f"{self.model_name} serves no embeddings", param="model")
        pooling = body.pooling or spec.poolings[0]
        if pooling not in spec.poolings:
            raise APIError(400, f"pooling must be one of {', '.join(spec.poolings)} for {self.model_name}, "
                                f"got {pooling!r}", param="pooling")
        return spec, pooling

    async def _tokenize(self, texts: list[str], param: str) -> list[list[int]]:
        limit = self.engine.bounds.max_prompts
        if not texts:
            raise APIError(400, f"{param} must not be empty", param=param)
        if len(texts) > limit:
            raise APIError(400, f"at most {limit} inputs per request, got {len(texts)}", param=param)
        if any(t == "" for t in texts):
            raise APIError(400, f"{param} must not hold an empty string", param=param)
        return [await self.encode(t, param) for t in texts]

    async def _embed(self, ctx: RequestContext, prompts: list[list[int]], pooling: str,
                     param: str) -> list[list[float]]:
        """One engine request per prompt, all under one admission; unit vectors in order."""
        params = self.prepare(ctx, prompts, SamplingParams(pooling=pooling, max_tokens=None), {"prompt": param})
        streams = [self.generate(ctx, f"{ctx.request_id}-{i}", ids, params, None) for i, ids in enumerate(prompts)]
        vectors: list[list[float] | None] = [None] * len(prompts)
        async for i, out in merge_streams(streams):
            self.record(ctx, out)
            if out.finished:
                if out.embedding is None:  # aborted: the deadline, or the engine stopping
                    if out.stop_reason == "deadline":
                        raise APIError(504, "the request's deadline passed before it finished; its work was "
                                            "abandoned", code="deadline_exceeded")
                    raise APIError(503, "the engine stopped before the embedding was computed",
                                   code="engine_unavailable")
                vectors[i] = unit(out.embedding)
        return vectors  # type: ignore[return-value]

    def _usage(self, ctx: RequestContext, num_prompt: int) -> dict[str, Any]:
        usage = self.finish_usage(ctx, self.usage(num_prompt, 0, 0))  # priced as input only
        out = {"prompt_tokens": num_prompt, "total_tokens": num_prompt}
        if "cost" in usage:
            out["cost"] = usage["cost"]
        return out

    # -- /v1/embeddings -----------------------------------------------------------------
    async def create(self, body: EmbeddingRequest, raw: Request, ctx: RequestContext) -> Response:
        return json_response(await run_until_disconnected(raw, self.embeddings(body, ctx)))

    async def embeddings(self, body: EmbeddingRequest, ctx: RequestContext) -> dict[str, Any]:
        spec, pooling = self._spec(body)
        dims = body.dimensions
        if dims is not None:
            if spec.truncatable is None:
                raise APIError(400, f"{self.model_name} does not support dimensions: it was not trained for "
                                    "truncated embeddings", param="dimensions")
            allowed = spec.truncatable or range(1, spec.size + 1)
            if dims not in allowed:
                raise APIError(400, f"dimensions must be {_sizes(spec)} for {self.model_name}, got {dims}",
                               param="dimensions")
        inp = body.input
        if isinstance(inp, str):
            prompts = await self._tokenize([inp], "input")
        elif inp and isinstance(inp[0], str):
            prompts = await self._tokenize(inp, "input")
        else:
            prompts = [inp] if inp and isinstance(inp[0], int) else inp
            if not prompts or any(not ids for ids in prompts):
                raise APIError(400, "input must not be empty", param="input")
        vectors = await self._embed(ctx, prompts, pooling, "input")
        data = []
        for i, vec in enumerate(vectors):
            if dims is not None and dims < len(vec):
                vec = unit(vec[:dims])
            emb: Any = vec
            if body.encoding_format == "base64":  # OpenAI's: little-endian float32, base64
                emb = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode("ascii")
            data.append({"object": "embedding", "index": i, "embedding": emb})
        return {"object": "list", "data": data, "model": self.model_name,
                "usage": self._usage(ctx, sum(len(p) for p in prompts))}

    # -- /v1/rerank ---------------------------------------------------------------------
    async def rerank(self, body: RerankRequest, ctx: RequestContext) -> dict[str, Any]:
        _, pooling = self._spec(body)
        limit = self.engine.bounds.max_prompts - 1  # the query is one input too
        docs = [d if isinstance(d, str) else d.text for d in body.documents]
        if not docs:
            raise APIError(400, "documents must not be empty", param="documents")
        if len(docs) > limit:
            raise APIError(400, f"at most {limit} documents per request, got {len(docs)}", param="documents")
        if body.query == "":
            raise APIError(400, "query must not be empty", param="query")
        prompts = await self._tokenize([body.query], "query") + await self._tokenize(docs, "documents")
        q, *vecs = await self._embed(ctx, prompts, pooling, "documents")
        scores = [sum(a * b for a, b in zip(q, v)) for v in vecs]
        order = sorted(range(len(docs)), key=lambda i: -scores[i])[:body.top_n or len(docs)]
        results = []
        for i in order:
            r: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if body.return_documents:
                r["document"] = {"text": docs[i]}
            results.append(r)
        return {"id": ctx.request_id, "object": "rerank", "created": now(), "model": self.model_name,
                "results": results, "usage": self._usage(ctx, sum(len(p) for p in prompts))}


def _sizes(spec: EmbeddingSpec) -> str:
    if spec.truncatable:
        return "one of " + ", ".join(map(str, spec.truncatable))
    return f"between 1 and {spec.size}"


class _Rerank:
    """The app's `serve` calls `create`: rerank through the same door as embeddings."""

    def __init__(self, serving: ServingEmbedding):
        self.serving = serving

    async def create(self, body: RerankRequest, raw: Request, ctx: RequestContext) -> Response:
        return json_response(await run_until_disconnected(raw, self.serving.rerank(body, ctx)))


def add_embedding_routes(app: FastAPI, serving: ServingEmbedding, serve) -> None:
    rerank = _Rerank(serving)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, raw: Request) -> Response:
        return await serve(raw, body, serving, "embd", "embeddings")

    @app.post("/v1/rerank")
    @app.post("/rerank")
    async def rerank_route(body: RerankRequest, raw: Request) -> Response:
        return await serve(raw, body, rerank, "rerank", "rerank")


def model_capabilities(spec: EmbeddingSpec | None) -> dict[str, Any]:
    """What /v1/models says a model serves: its task, endpoints, and how it embeds and reranks."""
    if spec is None:
        return {"task": "generate"}
    out: dict[str, Any] = {
        "task": "generate" if spec.generates else "embed",
        "capabilities": (["chat", "completions"] if spec.generates else []) + ["embeddings", "rerank"],
        "embedding": {"size": spec.size, "poolings": list(spec.poolings),
                      "dimensions": None if spec.truncatable is None else (list(spec.truncatable) or "any")},
        "rerank": RERANK_METHOD,
    }
    return out
