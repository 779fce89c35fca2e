"""`tokenmill rollout start|status|set|promote|abort`: a running server's rollouts and
shadows (serve --rollout, --shadow) from a terminal, through its HTTP routes (/v1/rollouts)."""

from __future__ import annotations

import json
from typing import Any, Optional

import typer

from tokenmill.batch.cli import KEY_HELP, URL_HELP, _Client

rollout_app = typer.Typer(add_completion=False, no_args_is_help=True,
                          help="Canary rollouts and shadows of a running server (serve --rollout, --shadow).")
DEFAULT_URL = "http://127.0.0.1:8000"


def _num(v: float | None, unit: str = "") -> str:
    return "-" if v is None else f"{v:.3g}{unit}"


def _arm(a: dict[str, Any]) -> str:
    return (f"{a['model']} w{a['weight']} ({a['requests']} req, {a['errors']} err; window {a['window']}: "
            f"error rate {_num(a['window_error_rate'])}, p99 {_num(a['window_p99_latency_s'], 's')}"
            + (f"; checked {a['passed']}/{a['checked']} passed, window success rate "
               f"{_num(a['window_success_rate'])}" if a.get("checked") else "") + ")")


def _show(r: dict[str, Any]) -> None:
    typer.echo(f"{r['id']}  {r['state']}  stable {_arm(r['stable'])}  canary {_arm(r['canary'])}")
    for d in r["decisions"][-3:]:
        ev = d.get("evidence") or {}
        before = "" if d["weights_before"] is None else f"{d['weights_before']} -> "
        typer.echo(f"  {d['action']} by {d['by']}: {before}{d['weights']}"
                   + (f" ({ev['rule']})" if ev else ""))


@rollout_app.command("status")
def status(name: Optional[str] = typer.Argument(None, help="One rollout (default: every rollout and shadow)."),
           url: str = typer.Option(DEFAULT_URL, "--base-url", help=URL_HELP),
           api_key: Optional[str] = typer.Option(None, "--api-key", help=KEY_HELP),
           as_json: bool = typer.Option(False, "--json", help="The route's JSON as it is.")) -> None:
    """Each arm's weight, requests, errors and p99 latency, and the latest decisions."""
    body = _Client(url, api_key).call("GET", "/rollouts" + (f"/{name}" if name else "")).json()
    if as_json:
        typer.echo(json.dumps(body, indent=2))
        return
    for r in [body] if name else body["data"]:
        _show(r)
    for s in [] if name else body["shadows"]:
        lat = s["latency"]
        typer.echo(f"shadow {s['id']} -> {s['model']} ({s['fraction']:g})  ok {s['ok']}, error {s['error']}, "
                   f"dropped {s['dropped']}, skipped {s['skipped']}; greedy matches {s['matches']}/{s['compared']}; "
                   f"p99 {_num(lat['primary_p99_s'], 's')} primary, {_num(lat['shadow_p99_s'], 's')} shadow")


def _post(url: str, api_key: Optional[str], name: str, body: dict) -> None:
    d = _Client(url, api_key).call("POST", f"/rollouts/{name}", json=body).json()
    typer.echo(f"{name}: {d['action']}, weights {d['weights_before']} -> {d['weights']}")


@rollout_app.command("start")
def start(spec: str = typer.Argument(..., help="NAME=STABLE:WEIGHT,CANARY:WEIGHT over two served models, as "
                                               "serve --rollout takes it."),
          url: str = typer.Option(DEFAULT_URL, "--base-url", help=URL_HELP),
          api_key: Optional[str] = typer.Option(None, "--api-key", help=KEY_HELP)) -> None:
    """A new rollout on the running server, judged by its thresholds from now on."""
    r = _Client(url, api_key).call("POST", "/rollouts", json={"rollout": spec}).json()
    typer.echo(f"{r['id']}: started, weights {r['stable']['model']}={r['stable']['weight']} "
               f"{r['canary']['model']}={r['canary']['weight']}")


@rollout_app.command("set")
def set_weights(name: str = typer.Argument(...),
                weights: list[str] = typer.Argument(..., help="MODEL=WEIGHT for each of the two arms."),
                url: str = typer.Option(DEFAULT_URL, "--base-url", help=URL_HELP),
                api_key: Optional[str] = typer.Option(None, "--api-key", help=KEY_HELP)) -> None:
    """New weights; the rollout runs (and is judged) again from fresh windows."""
    parsed = {}
    for w in weights:
        model, _, value = w.rpartition("=")
        if not model or not value.isdigit():
            typer.echo(f"error: {w!r} is not MODEL=WEIGHT", err=True)
            raise typer.Exit(2)
        parsed[model] = int(value)
    _post(url, api_key, name, {"weights": parsed})


@rollout_app.command("promote")
def promote(name: str = typer.Argument(...), url: str = typer.Option(DEFAULT_URL, "--base-url", help=URL_HELP),
            api_key: Optional[str] = typer.Option(None, "--api-key", help=KEY_HELP)) -> None:
    """All of the rollout's traffic to the canary."""
    _post(url, api_key, name, {"action": "promote"})


@rollout_app.command("abort")
def abort(name: str = typer.Argument(...), url: str = typer.Option(DEFAULT_URL, "--base-url", help=URL_HELP),
          api_key: Optional[str] = typer.Option(None, "--api-key", help=KEY_HELP)) -> None:
    """Roll back: the canary's weight to 0."""
    _post(url, api_key, name, {"action": "rollback"})
