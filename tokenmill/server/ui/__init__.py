"""The console at /ui: one static page (playground and dashboard) shipped in the
package, no build step and nothing fetched from elsewhere. It talks to the server only
through the public API (/v1/models, /v1/chat/completions, /v1/stats) with the API key
the user types, which stays in the browser."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from starlette.responses import FileResponse, Response

HERE = Path(__file__).parent
ASSETS = {"console.js": "text/javascript; charset=utf-8", "console.css": "text/css; charset=utf-8"}
# the page may load only what it ships and talk only to this server
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def add_console_routes(app: FastAPI, keys_required: bool) -> None:
    """`keys_required`: the server has a key store, so the page asks for a key before it
    calls the API (a call without one could only be refused)."""
    headers = {"Content-Security-Policy": CSP, "Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}
    page = (HERE / "index.html").read_text(encoding="utf-8").replace(
        'data-keys="{keys}"', f'data-keys="{"required" if keys_required else "none"}"')

    @app.get("/ui", include_in_schema=False)
    async def console() -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=headers)

    @app.get("/ui/{name}", include_in_schema=False)
    async def console_asset(name: str) -> Response:
        media = ASSETS.get(name)
        if media is None:  # a fixed list: no path from the URL reaches the filesystem
            return Response("not found", status_code=404, media_type="text/plain")
        return FileResponse(HERE / name, media_type=media, headers=headers)
