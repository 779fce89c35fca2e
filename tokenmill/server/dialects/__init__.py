"""Dialects: the other APIs clients speak (vLLM's /tokenize, Anthropic's Messages,
OpenAI's Responses, embeddings and rerank), each a translation at the edge onto the one
serving path. None has its own validation, gate, pricing or telemetry: each turns its
body into a ChatCompletionRequest (embeddings: pooling engine requests), runs it
through app.py's `serve` (the path /v1/chat/completions takes) and turns the answer
back."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from tokenmill.engine.api import EngineClient
from tokenmill.server.dialects.anthropic import add_messages_routes
from tokenmill.server.dialects.embeddings import ServingEmbedding, add_embedding_routes
from tokenmill.server.dialects.responses_routes import add_responses_routes
from tokenmill.server.dialects.tokenize import add_tokenize_routes
from tokenmill.server.serving_chat import ServingChat


def add_dialect_routes(app: FastAPI, engine: EngineClient, chat: ServingChat, gate: Any, serve: Callable,
                       data_dir: Path | None) -> None:
    """Every dialect's routes. Call it after the front door middleware is added: the
    Messages API's error shaping sits outside it. `data_dir`: where stored responses
    live (the Batch API's directory; None: /v1/responses is stateless)."""
    add_tokenize_routes(app, engine, chat)
    add_messages_routes(app, chat, serve, gate)
    add_responses_routes(app, chat, serve, data_dir)
    add_embedding_routes(app, ServingEmbedding(engine, chat.tokenizer, chat.model_name, chat.metrics), serve)
