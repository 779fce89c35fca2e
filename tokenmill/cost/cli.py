"""`tokenmill cost ...`: list rate cards, estimate a workload, price a benchmark run.

Thin: each command loads files through the package API and prints a rich table (or
JSON with `--json`). `cost_app` is registered by `tokenmill/cli.py`.
"""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path
from typing import Optional

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from tokenmill.cost.cards import RateCard, load_cards
from tokenmill.cost.estimate import Estimate, estimate_all, load_workload
from tokenmill.cost.from_bench import METHOD_FALLBACK, BenchRates, load_runs, price_run
from tokenmill.cost.values import ConfigError

cost_app = typer.Typer(add_completion=False, no_args_is_help=True,
                       help="What requests cost: rate cards, workload estimates, self-hosted prices.")

CARDS_HELP = "Rate card file (.toml/.yaml) or folder of them (default: the cards shipped with tokenmill)."


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=2)


def _console() -> Console:
    console = Console()
    # Piped output gets rich's 80-column default, which truncates figures; a file or
    # pipe has no width to respect, so give the tables room.
    if not console.is_terminal and console.width < 120:
        return Console(width=120)
    return console


def _usd(value: Decimal | None) -> str:
    """Human USD: cents for big sums, four significant digits for small ones."""
    if value is None:
        return "-"
    if not value.is_finite():
        return "n/a"
    if abs(value) >= 100:
        return f"{value:,.2f}"
    if value == 0:
        return "0"
    return f"{float(value):.4g}"


def _price(value: Decimal | None) -> str:
    return "-" if value is None else f"{value.normalize():f}"


@cost_app.command("cards")
def cards_cmd(cards: Optional[Path] = typer.Option(None, "--cards", help=CARDS_HELP)) -> None:
    """List rate cards (USD per 1M tokens)."""
    try:
        loaded = load_cards(cards)
    except ConfigError as exc:
        _fail(str(exc))
    dates = {c.as_of for c in loaded.values()}
    one_date = len(dates) == 1
    title = "Rate cards, USD per 1M tokens" + (f", as of {next(iter(dates))}" if one_date else "")
    table = Table(title=title, box=box.SIMPLE_HEAD)
    table.add_column("card", no_wrap=True)
    if not one_date:
        table.add_column("as of", no_wrap=True)
    for col in ("input", "cached", "cache\nwrite", "output", "batch\nin/out"):
        table.add_column(col, justify="right", no_wrap=True)
    table.add_column("long ctx", justify="right", no_wrap=True)
    for c in loaded.values():
        dated = [] if one_date else [c.as_of.isoformat()]
        table.add_row(c.name, *dated, _price(c.prices.input), _price(c.prices.cached_input),
                      _price(c.prices.cache_write), _price(c.prices.output), _batch(c), _long_context(c))
    console = _console()
    console.print(table)
    for c in loaded.values():
        if c.long_context is not None:
            lc = c.long_context
            console.print(f"{c.name}: a prompt above {lc.threshold_tokens:,} tokens re-prices the whole request "
                          f"at {_price(lc.input_multiplier)}x input and {_price(lc.output_multiplier)}x output.")
    if any(c.machine for c in loaded.values()):
        console.print("Self-hosted cards are priced from machine USD/hour and measured throughput.")


def _batch(c: RateCard) -> str:
    if c.batch is None:
        return "none"
    note = f" ({c.batch_note})" if c.batch_note and c.batch_note != "published" else ""
    return f"{_price(c.batch.input)}/{_price(c.batch.output)}{note}"


def _long_context(c: RateCard) -> str:
    return "-" if c.long_context is None else f">{c.long_context.threshold_tokens:,}"


@cost_app.command("estimate")
def estimate_cmd(
    workload: Path = typer.Argument(..., help="Workload description (.toml or .yaml)."),
    cards: Optional[Path] = typer.Option(None, "--cards", help=CARDS_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Monthly cost of WORKLOAD per rate card, and cost per successful task."""
    try:
        w = load_workload(workload)
        results = estimate_all(w, load_cards(cards))
    except ConfigError as exc:
        _fail(str(exc))
    if as_json:
        typer.echo(json.dumps([_estimate_json(e) for e in results], indent=2))
        return
    table = Table(title=f"{w.name}: {w.requests_per_month:,} requests/month", box=box.SIMPLE_HEAD)
    table.add_column("card", no_wrap=True)
    for col in ("USD/month", "USD/task\nok", "in\nUSD/1M", "out\nUSD/1M", "long\nctx"):
        table.add_column(col, justify="right", no_wrap=True)
    for e in sorted(results, key=lambda e: e.monthly_usd):
        mark = " *" if e.batch_at_list else ""
        share = "-" if e.long_context_share is None else f"{float(e.long_context_share):.1%}"
        table.add_row(e.card + mark, _usd(e.monthly_usd), _usd(e.usd_per_success), _usd(e.usd_per_mtok_input),
                      _usd(e.usd_per_mtok_output), share)
    console = _console()
    console.print(table)
    console.print(
        f"input {w.input_tokens.describe()}, output {w.output_tokens.describe()}; cache hit {w.cache_hit_rate}, "
        f"batch share {w.batch_share}, retry rate {w.retry_rate}, task success {w.task_success_rate}.\n"
        "Expected values, computed analytically from the distributions (long ctx: share of requests above "
        "the card's threshold, from the input distribution's tail). 'task ok': per successful task. USD/1M "
        "are effective rates for this workload (cache, batch and long-context prices included).")
    if any(e.batch_at_list for e in results):
        console.print("* no published batch price: the batch share is billed at list.")


def _estimate_json(e: Estimate) -> dict:
    return {"card": e.card, "monthly_usd": float(e.monthly_usd), "usd_per_success": float(e.usd_per_success),
            "input_usd": float(e.input_usd), "output_usd": float(e.output_usd),
            "usd_per_mtok_input": float(e.usd_per_mtok_input), "usd_per_mtok_output": float(e.usd_per_mtok_output),
            "long_context_share": None if e.long_context_share is None else float(e.long_context_share),
            "batch_at_list": e.batch_at_list}


@cost_app.command("from-bench")
def from_bench_cmd(
    results: Path = typer.Argument(..., help="Benchmark results JSON (tokenmill bench)."),
    usd_per_hour: float = typer.Option(..., "--usd-per-hour", help="What the benchmarked machine costs per hour."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Self-hosted USD per 1M input and output tokens for each run in RESULTS."""
    try:
        priced = [price_run(run, Decimal(repr(usd_per_hour))) for run in load_runs(results)]
    except ConfigError as exc:
        _fail(str(exc))
    if as_json:
        typer.echo(json.dumps([_bench_json(r) for r in priced], indent=2))
        return
    table = Table(title=f"Self-hosted prices at ${usd_per_hour:g}/hour", box=box.SIMPLE_HEAD)
    table.add_column("run (mode)", no_wrap=True)
    for col in ("conc", "secs", "machine\nUSD", "prefill\nshare", "in\nUSD/1M", "out\nUSD/1M",
                "out (all)\nUSD/1M", "USD/req"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in priced:
        run = r.run
        table.add_row(f"{run.label} ({run.mode})" if run.mode else run.label, "" if run.concurrency is None else str(run.concurrency),
                      f"{run.duration_s:f}", _usd(r.machine_usd),
                      "-" if r.method == METHOD_FALLBACK else f"{float(r.prefill_share):.1%}",
                      _usd(r.usd_per_mtok_input), _usd(r.usd_per_mtok_output), _usd(r.usd_per_mtok_output_all),
                      _usd(r.usd_per_request))
    console = _console()
    console.print(table)
    console.print(
        "Method: the run's machine cost (USD/hour x duration) is split between input and output tokens by "
        "prefill share = mean TTFT / mean end-to-end latency (requests in flight share the machine, so a "
        "request's prefill phase holds it in proportion to its TTFT). TTFT includes queueing, so an overloaded "
        "run over-prices input. 'out (all)' charges the whole bill to output tokens.")
    if any(r.method == METHOD_FALLBACK for r in priced):
        console.print("Runs with prefill '-' lack ttft_ms.mean or e2e_ms.mean: all cost goes to output.")


def _bench_json(r: BenchRates) -> dict:
    def num(d: Decimal | None) -> float | None:
        return None if d is None or not d.is_finite() else float(d)

    return {"label": r.run.label, "method": r.method, "usd_per_hour": float(r.usd_per_hour),
            "machine_usd": float(r.machine_usd), "prefill_share": float(r.prefill_share),
            "usd_per_mtok_input": num(r.usd_per_mtok_input), "usd_per_mtok_output": num(r.usd_per_mtok_output),
            "usd_per_mtok_output_all": num(r.usd_per_mtok_output_all), "usd_per_request": num(r.usd_per_request)}
