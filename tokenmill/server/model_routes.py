"""POST /v1/models/{id}/load and /unload: the operator's hand on the several-models router."""

from __future__ import annotations

import json

from fastapi import FastAPI, Request

from tokenmill.engine.api import ModelHost, ModelUnavailable, UnknownModel
from tokenmill.server.errors import APIError, as_api_error
from tokenmill.server.keys import Tenant
from tokenmill.server.limits import parse_keep_alive


def add_model_routes(app: FastAPI, host: ModelHost, keys_on: bool, rows) -> None:
    """POST /v1/models/{id}/load and /unload: an operator's (an admin key's, when keys are on)."""

    def check(raw: Request, model: str) -> None:
        tenant: Tenant = raw.scope["state"]["tenant"]
        if keys_on and not tenant.admin:
            raise APIError(403, "loading and unloading models needs an admin key (tokenmill keys add NAME --admin)",
                           code="permission_denied")
        if model not in host.model_names():
            raise APIError(404, str(UnknownModel(model, host.model_names())), param="model",
                           code="model_not_found")

    def row(model: str) -> dict:
        return next(r for r in rows() if r["id"] == model)

    @app.post("/v1/models/{model:path}/load")
    async def load_model(model: str, raw: Request) -> dict:
        check(raw, model)
        keep_alive = None
        if await raw.body():
            try:
                body = json.loads(await raw.body())
            except ValueError:
                raise APIError(400, "the request body is not valid JSON") from None
            if not isinstance(body, dict):
                raise APIError(400, "the body must be a JSON object")
            if body.get("keep_alive") is not None:
                try:
                    keep_alive = parse_keep_alive(body["keep_alive"])
                except ValueError as exc:
                    raise APIError(400, str(exc), param="keep_alive") from None
        try:
            await host.load(model, keep_alive)
        except ModelUnavailable as exc:
            raise as_api_error(exc) from None
        return row(model)

    @app.post("/v1/models/{model:path}/unload")
    async def unload_model(model: str, raw: Request) -> dict:
        check(raw, model)
        await host.unload(model)
        return row(model)
