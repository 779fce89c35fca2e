"""`tokenmill eval SUITE`: run a task suite against one or several servers and report.

`eval_command` is a plain function whose defaults are typer options, registered by
tokenmill/cli.py as `app.command("eval")(eval_command)`.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any, Optional

import typer

from tokenmill.bench.cli import command_line
from tokenmill.eval.runner import Answer, EvalError, Settings, Target, discover_model, run_target
from tokenmill.eval.sandbox import NOBODY, Limits, Sandbox
from tokenmill.eval.suite import SuiteError, load_suite


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=2)


def parse_targets(base_urls: list[str], compare: Optional[str], model: Optional[str],
                  api_key: Optional[str]) -> list[Target]:
    """--base-url (repeatable) and --compare URL1,URL2: each entry `URL` or `LABEL=URL`."""
    entries = list(base_urls) + [e.strip() for e in (compare or "").split(",") if e.strip()]
    if not entries:
        entries = ["http://127.0.0.1:8000"]
    targets = []
    for entry in entries:
        label, _, url = entry.rpartition("=") if "=" in entry.split("://")[0] else ("", "", entry)
        if not url.startswith(("http://", "https://")):
            raise EvalError(f"not an http(s) URL: {entry!r}")
        targets.append(Target(label=label or url, base_url=url, model=model, api_key=api_key))
    labels = [t.label for t in targets]
    if len(set(labels)) != len(labels):
        raise EvalError(f"two configurations share a label: {labels} (name them LABEL=URL)")
    return targets


def pick_card(cards_path: Optional[Path], card_name: Optional[str], model: str, usd_per_hour: Optional[float]):
    from tokenmill.cost import find_card, load_cards, with_machine

    cards = load_cards(cards_path)
    if card_name is not None:
        if card_name not in cards:
            raise EvalError(f"no rate card named {card_name!r} (have: {', '.join(sorted(cards))})")
        card = cards[card_name]
    else:  # the model's own card, else our self-hosted one
        card = find_card(cards, model) or cards.get("tokenmill-default")
        if card is None:
            raise EvalError(f"no rate card for model {model!r}; pass --card")
    if card.machine is not None and usd_per_hour is not None:
        card = with_machine(card, usd_per_hour=usd_per_hour)
    return card


def eval_command(
    ctx: typer.Context,
    suite: str = typer.Argument(..., help="A shipped suite (code, json, short) or a JSONL file of tasks."),
    base_url: list[str] = typer.Option([], "--base-url",
                                       help="Server root (or .../v1); repeat to compare. LABEL=URL names it."),
    compare: Optional[str] = typer.Option(None, "--compare",
                                          help="Comma-separated servers to compare on the same suite "
                                               "(URL or LABEL=URL each)."),
    model: Optional[str] = typer.Option(None, "--model", help="Model id (default: first of GET /v1/models)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="TOKENMILL_API_KEY"),
    concurrency: int = typer.Option(4, "--concurrency", min=1, help="Requests in flight."),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0),
    seed: Optional[int] = typer.Option(None, "--seed", help="Sent with every request."),
    structured: bool = typer.Option(False, "--structured",
                                    help="Send JSON tasks' schemas as response_format (constrained output)."),
    usd_per_hour: Optional[float] = typer.Option(None, "--usd-per-hour", min=0.0,
                                                 help="The server machine's price: machine cost per success."),
    card: Optional[str] = typer.Option(None, "--card",
                                       help="Rate card name (default: the model's card, else tokenmill-default)."),
    cards: Optional[Path] = typer.Option(None, "--cards", help="Rate card file or folder (default: shipped)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write results.json, report.md and eval.png here."),
    no_plot: bool = typer.Option(False, "--no-plot", help="Skip the PNG plot."),
    request_timeout: float = typer.Option(300.0, "--request-timeout", min=1.0, help="Seconds per request."),
    task_timeout: float = typer.Option(10.0, "--task-timeout", min=0.1,
                                       help="Wall seconds for one code answer and its tests."),
    task_memory_mb: int = typer.Option(512, "--task-memory-mb", min=64, help="Address space per process."),
    sandbox_uid: int = typer.Option(NOBODY, "--sandbox-uid", min=1,
                                    help="Unprivileged uid (and gid) for code answers when run as root."),
) -> None:
    """Run a task suite against OpenAI-compatible servers: success rate, latency, cost per successful task."""
    try:
        tasks = load_suite(suite)
        targets = parse_targets(base_url, compare, model, api_key)
        limits = Limits(wall_s=task_timeout, cpu_s=max(1, int(task_timeout + 0.999)), memory_mb=task_memory_mb)
        sandbox = Sandbox(limits, uid=sandbox_uid, gid=sandbox_uid)
    except (SuiteError, EvalError, ValueError) as exc:
        _fail(str(exc))
    settings = Settings(concurrency=concurrency, temperature=temperature, seed=seed,
                        request_timeout_s=request_timeout, structured=structured)
    from tokenmill.eval.report import markdown, summary, table, write_plot

    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    configs: list[dict[str, Any]] = []
    details: list[dict[str, Any]] = []
    for target in targets:
        try:
            model_id = target.model or discover_model(target)
            rate_card = pick_card(cards, card, model_id, usd_per_hour)
        except (EvalError, ValueError) as exc:
            _fail(str(exc))
        typer.echo(f"{target.label}: {len(tasks.tasks)} tasks, model {model_id}", err=True)
        done = [0]

        def progress(ans: Answer) -> None:
            done[0] += 1
            status = "answered" if ans.ok else f"failed ({ans.error})"
            typer.echo(f"  [{done[0]}/{len(tasks.tasks)}] {ans.task_id}: {status} in {ans.latency_s:.1f}s", err=True)

        run = run_target(Target(target.label, target.base_url, model_id, target.api_key), tasks, settings, sandbox,
                         on_answer=progress)
        s = summary(run, rate_card, usd_per_hour)
        configs.append(s)
        details.append({"label": target.label, "answers": [a.to_json() for a in run.answers]})
        typer.echo(f"{target.label}: passed {s['passed']}/{s['tasks']} in {s['machine_s']:.1f}s", err=True)
    results = {"meta": {"suite": tasks.name, "source": tasks.source, "tasks": len(tasks.tasks),
                        "command": command_line(ctx, "eval"), "started_at": started, "temperature": temperature,
                        "concurrency": concurrency, "structured": structured, "seed": seed,
                        "usd_per_hour": usd_per_hour, "sandbox": sandbox.describe()},
               "configs": configs, "answers": details}
    typer.echo(table(results))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        plot = None if no_plot else write_plot(results, out / "eval.png").name
        (out / "results.json").write_text(json.dumps(results, indent=1))
        (out / "report.md").write_text(markdown(results, plot))
        typer.echo(f"wrote {out / 'results.json'}, {out / 'report.md'}" + (f", {out / plot}" if plot else ""),
                   err=True)
    if any(s["check_errors"] for s in configs):
        typer.echo("error: some answers could not be checked (sandbox errors); see results.json", err=True)
        raise typer.Exit(code=1)
