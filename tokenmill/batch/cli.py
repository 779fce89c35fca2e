"""`tokenmill batch submit|status|list|cancel|results`: the Batch API from a terminal.

A client of the HTTP API like any other (it imports nothing of the server), so it
works against any server that speaks OpenAI's Files and Batches API.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

import typer

batch_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Submit and follow Batch API jobs.")
URL_HELP = "The server's base URL."
KEY_HELP = "API key (default: $TOKENMILL_API_KEY, then $OPENAI_API_KEY)."
FINAL = ("completed", "failed", "expired", "cancelled")


class _Client:
    def __init__(self, url: str, api_key: Optional[str]):
        import httpx

        key = api_key or os.environ.get("TOKENMILL_API_KEY") or os.environ.get("OPENAI_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.base = url.rstrip("/")
        if not self.base.endswith("/v1"):
            self.base += "/v1"
        self.http = httpx.Client(headers=headers, timeout=120)

    def call(self, method: str, path: str, **kwargs) -> Any:
        import httpx

        try:
            r = self.http.request(method, self.base + path, **kwargs)
        except httpx.HTTPError as exc:
            _fail(f"cannot reach {self.base}: {exc}")
        if r.status_code >= 400:
            try:
                message = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = r.text[:500]
            _fail(f"{method} {path}: {r.status_code} {message}")
        return r


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=1)


def _summary(b: dict[str, Any]) -> str:
    c = b.get("request_counts") or {}
    u = b.get("usage") or {}
    parts = [f"{b['id']}  {b['status']}", f"{c.get('completed', 0)}/{c.get('total', 0)} done",
             f"{c.get('failed', 0)} failed", f"{u.get('input_tokens', 0)} in / {u.get('output_tokens', 0)} out tokens"]
    cost = b.get("cost") or {}
    if cost.get("total_usd") is not None:
        parts.append(f"${cost['total_usd']:.6f}")
    if b.get("errors"):
        errs = b["errors"].get("data") or []
        parts.append(f"{len(errs)} validation errors (first: line {errs[0].get('line')}: {errs[0].get('message')})"
                     if errs else "")
    return "  ".join(p for p in parts if p)


@batch_app.command("submit")
def submit(
    file: Path = typer.Argument(..., exists=True, dir_okay=False, help="JSONL file of requests."),
    endpoint: Optional[str] = typer.Option(None, "--endpoint", help="Default: the url of the file's first line."),
    window: str = typer.Option("24h", "--window", help="completion_window."),
    metadata: list[str] = typer.Option([], "--metadata", help="key=value (repeatable)."),
    wait: bool = typer.Option(False, "--wait", help="Follow the batch to its end with a progress bar."),
    url: str = typer.Option("http://127.0.0.1:8000", "--url", help=URL_HELP),
    api_key: Optional[str] = typer.Option(None, "--api-key", help=KEY_HELP),
) -> None:
    """Upload FILE and start a batch on it; print the batch id (and follow it with --wait)."""
    if endpoint is None:
        with open(file, "rb") as f:
            first = next((line for line in f if line.strip()), b"")
        try:
            endpoint = json.loads(first).get("url")
        except (ValueError, AttributeError):
            endpoint = None
        if not isinstance(endpoint, str):
            _fail("cannot tell the endpoint from the file's first line; pass --endpoint")
    meta = {}
    for kv in metadata:
        k, sep, v = kv.partition("=")
        if not sep:
            _fail(f"--metadata takes key=value, got {kv!r}")
        meta[k] = v
    client = _Client(url, api_key)
    with open(file, "rb") as f:
        uploaded = client.call("POST", "/files", files={"file": (file.name, f)}, data={"purpose": "batch"}).json()
    body: dict[str, Any] = {"input_file_id": uploaded["id"], "endpoint": endpoint, "completion_window": window}
    if meta:
        body["metadata"] = meta
    b = client.call("POST", "/batches", json=body).json()
    typer.echo(b["id"])
    if wait:
        b = _follow(client, b["id"])
        typer.echo(_summary(b), err=True)
        if b["status"] != "completed":
            raise typer.Exit(code=1)


def _follow(client: _Client, batch_id: str) -> dict[str, Any]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    # on stderr: stdout carries only the batch id, for scripts
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True)) as bar:
        task = bar.add_task("validating", total=None)
        while True:
            b = client.call("GET", f"/batches/{batch_id}").json()
            c = b["request_counts"]
            bar.update(task, description=b["status"], total=c["total"] or None,
                       completed=c["completed"] + c["failed"])
            if b["status"] in FINAL:
                return b
            time.sleep(0.5)


@batch_app.command("status")
def status(batch_id: str = typer.Argument(...), as_json: bool = typer.Option(False, "--json"),
           url: str = typer.Option("http://127.0.0.1:8000", "--url", help=URL_HELP),
           api_key: Optional[str] = typer.Option(None, "--api-key", help=KEY_HELP)) -> None:
    """One batch: status, counts, usage, cost."""
    b = _Client(url, api_key).call("GET", f"/batches/{batch_id}").json()
    typer.echo(json.dumps(b, indent=2) if as_json else _summary(b))


@batch_app.command("list")
def list_batches(limit: int = typer.Option(20, "--limit"),
                 url: str = typer.Option("http://127.0.0.1:8000", "--url", help=URL_HELP),
                 api_key: Optional[str] = typer.Option(None, "--api-key", help=KEY_HELP)) -> None:
    """This key's batches, newest first."""
    page = _Client(url, api_key).call("GET", "/batches", params={"limit": limit}).json()
    for b in page["data"]:
        typer.echo(_summary(b))


@batch_app.command("cancel")
def cancel(batch_id: str = typer.Argument(...),
           url: str = typer.Option("http://127.0.0.1:8000", "--url", help=URL_HELP),
           api_key: Optional[str] = typer.Option(None, "--api-key", help=KEY_HELP)) -> None:
    """Stop issuing a batch's lines; what finished is kept."""
    typer.echo(_summary(_Client(url, api_key).call("POST", f"/batches/{batch_id}/cancel").json()))


@batch_app.command("results")
def results(batch_id: str = typer.Argument(...),
            output: Optional[Path] = typer.Option(None, "-o", "--output", help="Write here (default: stdout)."),
            errors: bool = typer.Option(False, "--errors", help="The error file instead of the output file."),
            url: str = typer.Option("http://127.0.0.1:8000", "--url", help=URL_HELP),
            api_key: Optional[str] = typer.Option(None, "--api-key", help=KEY_HELP)) -> None:
    """A finished batch's output (or error) file, as JSONL."""
    client = _Client(url, api_key)
    b = client.call("GET", f"/batches/{batch_id}").json()
    file_id = b["error_file_id" if errors else "output_file_id"]
    if file_id is None:
        if b["status"] not in FINAL:
            _fail(f"the batch is {b['status']}; its files are written when it ends")
        typer.echo(f"the batch ({b['status']}) has no {'error' if errors else 'output'} file", err=True)
        return
    data = client.call("GET", f"/files/{file_id}/content").content
    if output is None:
        sys.stdout.buffer.write(data)
    else:
        output.write_bytes(data)
        lines = data.count(b"\n")
        typer.echo(f"wrote {lines} lines to {output}", err=True)
