"""LoRA adapters at run time, with vLLM's routes and bodies:
`POST /v1/load_lora_adapter {"lora_name", "lora_path"}` and
`POST /v1/unload_lora_adapter {"lora_name"}`. Admin keys only when keys are on (an
adapter's path is read on the server's disk). Requests name a loaded adapter as their
`model`; `/v1/models` lists it with its `parent`.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from tokenmill.engine.api import EngineClient
from tokenmill.server.errors import APIError


class LoadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None  # (vLLM's clients may send it; names are what we key by)


def add_lora_routes(app: FastAPI, engine: EngineClient, open_server: bool) -> None:
    def check_admin(raw: Request) -> None:
        tenant = raw.scope["state"].get("tenant")
        if not open_server and not getattr(tenant, "admin", False):
            raise APIError(403, "loading and unloading LoRA adapters needs an admin key", code="forbidden")

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraRequest, raw: Request) -> dict:
        check_admin(raw)
        info = await engine.load_adapter(body.lora_name, body.lora_path)
        return {"object": "lora_adapter", "status": "loaded", **info}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraRequest, raw: Request) -> dict:
        check_admin(raw)
        await engine.unload_adapter(body.lora_name)
        return {"object": "lora_adapter", "status": "unloaded", "name": body.lora_name}
