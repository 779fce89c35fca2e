"""`tokenmill bench`: options in, a benchmark run, results and a report out.

`bench` is a plain function whose defaults are typer options, ready for
`app.command()(bench)` in tokenmill/cli.py; `python -m tokenmill.bench` runs it alone.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any, Optional

import typer

from tokenmill.bench.client import ClientConfig, RequestRecord
from tokenmill.bench.harness import BenchConfig, BenchError, check_target, discover_model, run_benchmark
from tokenmill.bench.runner import RunSpec
from tokenmill.bench.stats import Slo
from tokenmill.bench.agent import file_conversations
from tokenmill.bench.workload import AgentConfig, LengthDist, WorkloadConfig


def parse_sweep(text: Optional[str], kind: type, name: str) -> list[Any]:
    """'1,2,4' -> [1, 2, 4]; None or '' -> []."""
    if not text:
        return []
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise BenchError(f"{name}: expected comma-separated numbers, got {text!r}") from exc
    if any(v <= 0 for v in values):
        raise BenchError(f"{name}: values must be > 0, got {text!r}")
    return values


def parse_extra_body(text: Optional[str]) -> Optional[dict[str, Any]]:
    if not text:
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BenchError(f"--extra-body is not JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise BenchError("--extra-body must be a JSON object")
    return obj


class RichProgress:
    """A rich progress bar: one task per run, advanced as each request finishes."""

    def __init__(self, enabled: bool) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        # stderr: stdout carries the JSON summary when there is no --out
        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("ok {task.fields[ok]} err {task.fields[err]}"),
                                 TimeElapsedColumn(), console=Console(stderr=True),
                                 disable=not enabled, transient=False)
        self.task: Optional[Any] = None
        self.ok = self.err = 0

    def start(self, label: str, total: int) -> None:
        if self.task is not None:
            # Runs end early on --duration: show the bar as done at what was sent.
            self.progress.update(self.task, total=self.ok + self.err)
        self.ok = self.err = 0
        self.task = self.progress.add_task(label, total=total, ok=0, err=0)

    def done(self, rec: RequestRecord) -> None:
        self.ok, self.err = self.ok + rec.ok, self.err + (not rec.ok)
        if self.task is not None:
            self.progress.update(self.task, advance=1, ok=self.ok, err=self.err)

    def __enter__(self) -> "RichProgress":
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.task is not None:
            self.progress.update(self.task, total=self.ok + self.err)
        self.progress.stop()


def print_summary(results: dict[str, Any]) -> None:
    """A compact table on stderr (fits 80 columns); errors listed under it."""
    from rich.console import Console
    from rich.table import Table

    from rich import box

    t = Table(title=f"{results['meta']['model']} @ {results['meta']['base_url']}", box=box.SIMPLE_HEAD)
    for col in ("run", "ok", "req/s", "goodput\nreq/s", "output\ntok/s", "TTFT ms\np50 / p99",
                "ITL ms\np50 / p99", "cached"):
        t.add_column(col, justify="right", no_wrap=True)
    f = lambda x, nd=1: "-" if x is None else f"{x:.{nd}f}"  # noqa: E731
    errors = []
    for r in results["runs"]:
        t.add_row(r["label"], f"{r['num_ok']}/{r['num_requests']}", f(r["requests_per_s"], 2),
                  f(r["goodput_rps"], 2), f(r["output_tokens_per_s"]),
                  f"{f(r['ttft_ms']['p50'])} / {f(r['ttft_ms']['p99'])}",
                  f"{f(r['itl_ms']['p50'])} / {f(r['itl_ms']['p99'])}",
                  "-" if r.get("cached_token_share") is None else f"{r['cached_token_share']:.0%}")
        if r["errors_by_kind"]:
            errors.append(f"{r['label']} errors: " + ", ".join(f"{k} x{v}" for k, v in r["errors_by_kind"].items()))
    console = Console(stderr=True)
    console.print(t)
    for line in errors:
        console.print(line, style="red")


def bench(
    ctx: typer.Context,
    base_url: str = typer.Option("http://127.0.0.1:8000", "--base-url", help="Server root (or .../v1)."),
    model: Optional[str] = typer.Option(None, "--model", help="Model id (default: first of GET /v1/models)."),
    endpoint: str = typer.Option("completions", "--endpoint", help="completions or chat."),
    concurrency: Optional[str] = typer.Option(None, "--concurrency",
                                              help="Closed-loop sweep, e.g. 1,2,4,8,16,32."),
    request_rate: Optional[str] = typer.Option(None, "--request-rate",
                                               help="Open-loop Poisson sweep in req/s, e.g. 0.5,1,2."),
    max_concurrency: Optional[int] = typer.Option(None, "--max-concurrency",
                                                  help="Cap on in-flight requests in open loop."),
    num_requests: int = typer.Option(64, "--num-requests", help="Requests per run (upper bound)."),
    duration: Optional[float] = typer.Option(None, "--duration",
                                             help="Seconds per run after which no new request starts."),
    input_len: int = typer.Option(128, "--input-len", help="Mean prompt length in tokens."),
    input_dist: str = typer.Option("fixed", "--input-dist", help="fixed, uniform or normal."),
    input_spread: float = typer.Option(0.25, "--input-spread", help="Relative spread (uniform ±, normal σ)."),
    output_len: int = typer.Option(64, "--output-len", help="Mean max_tokens per request."),
    output_dist: str = typer.Option("fixed", "--output-dist", help="fixed, uniform or normal."),
    output_spread: float = typer.Option(0.25, "--output-spread", help="Relative spread of output lengths."),
    shared_prefix: float = typer.Option(0.0, "--shared-prefix",
                                        help="Fraction (0..1) of each prompt shared by all requests."),
    prompts_file: Optional[Path] = typer.Option(None, "--prompts-file",
                                                help="JSONL of {prompt|messages[, max_tokens]}; with --conversations, "
                                                     "of conversations {system, turns}."),
    conversations: Optional[int] = typer.Option(
        None, "--conversations", help="Agent workload: this many multi-turn conversations (--concurrency of them "
                                      "at a time), each turn's prompt the last one's plus its answer plus a new "
                                      "user message of --input-len tokens (or replayed from a --prompts-file trace)."),
    turns: int = typer.Option(4, "--turns", help="Agent workload: turns per conversation."),
    prefix_len: int = typer.Option(1500, "--prefix-len",
                                   help="Agent workload: tokens of the system prompt every conversation opens with."),
    num_prefixes: int = typer.Option(1, "--num-prefixes", help="Agent workload: how many such system prompts."),
    think_time: float = typer.Option(0.0, "--think-time",
                                     help="Agent workload: mean seconds between an answer and the next turn."),
    seed: int = typer.Option(0, "--seed", help="Seed for prompts, lengths and arrivals."),
    temperature: float = typer.Option(0.0, "--temperature"),
    no_ignore_eos: bool = typer.Option(False, "--no-ignore-eos", help="Do not send ignore_eos: true."),
    extra_body: Optional[str] = typer.Option(None, "--extra-body",
                                             help="JSON object merged into every request body."),
    slo_ttft_ms: Optional[float] = typer.Option(None, "--slo-ttft-ms", help="TTFT objective for goodput."),
    slo_itl_ms: Optional[float] = typer.Option(None, "--slo-itl-ms", help="Mean-ITL objective for goodput."),
    warmup: int = typer.Option(1, "--warmup", help="Unrecorded warm-up requests before the first run."),
    request_timeout: float = typer.Option(600.0, "--request-timeout", help="Seconds per request."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write results.json, report.md, PNG plots here."),
    no_plots: bool = typer.Option(False, "--no-plots", help="Skip the PNG plots."),
    no_progress: bool = typer.Option(False, "--no-progress", help="No progress bar."),
    allow_remote: bool = typer.Option(False, "--allow-remote", help="Allow a non-loopback --base-url."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="TOKENMILL_API_KEY"),
) -> None:
    """Benchmark any OpenAI-compatible server: latency, throughput and goodput under load."""
    try:
        check_target(base_url, allow_remote)
        if endpoint not in ("completions", "chat"):
            raise BenchError(f"--endpoint must be completions or chat, got {endpoint!r}")
        conc = parse_sweep(concurrency, int, "--concurrency")
        rates = parse_sweep(request_rate, float, "--request-rate")
        if not conc and not rates:
            conc = [1]
        agent = agent_config(ctx, conversations, turns, prefix_len, num_prefixes, think_time, prompts_file)
        if prompts_file is not None and not prompts_file.is_file():
            raise BenchError(f"--prompts-file {prompts_file} does not exist")
        workload = WorkloadConfig(
            input_len=LengthDist(input_len, input_dist, input_spread),  # type: ignore[arg-type]
            output_len=LengthDist(output_len, output_dist, output_spread),  # type: ignore[arg-type]
            shared_prefix=shared_prefix, prompts_file=prompts_file, seed=seed, agent=agent)
        if agent is not None:  # a cap: every turn of every conversation
            num_requests = (sum(len(c.turns) for c in file_conversations(workload)) if prompts_file
                            else agent.num_requests)
        runs = tuple([RunSpec("closed", num_requests, duration, concurrency=c) for c in conc]
                     + [RunSpec("open", num_requests, duration, request_rate=r,
                                max_concurrency=max_concurrency) for r in rates])
        extra = parse_extra_body(extra_body)
        model_id = model or discover_model(base_url, api_key)
        client = ClientConfig(base_url=base_url, model=model_id, endpoint=endpoint,  # type: ignore[arg-type]
                              temperature=temperature, ignore_eos=not no_ignore_eos, api_key=api_key,
                              request_timeout_s=request_timeout, extra_body=extra)
        cfg = BenchConfig(client=client, workload=workload, runs=runs,
                          slo=Slo(slo_ttft_ms, slo_itl_ms), warmup=warmup,
                          command=command_line(ctx))
    except (BenchError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2)
    with RichProgress(enabled=not no_progress) as prog:
        try:
            results = run_benchmark(cfg, on_start=prog.start, on_done=prog.done)
        except ValueError as exc:  # e.g. a malformed prompts file
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(code=2)
    print_summary(results)
    if out is not None:
        from tokenmill.bench.report import write_results

        paths = write_results(results, out, with_plots=not no_plots)
        typer.echo(f"wrote {', '.join(str(p) for p in paths.values())}", err=True)
    else:
        typer.echo(json.dumps({"meta": results["meta"], "runs": [
            {k: v for k, v in r.items() if k != "requests"} for r in results["runs"]]}, indent=1))


AGENT_ONLY = ("turns", "prefix_len", "num_prefixes", "think_time")
NOT_WITH_AGENT = {"num_requests": "--num-requests (the agent workload sends every turn of every conversation)",
                  "request_rate": "--request-rate (conversations run in a closed loop: use --concurrency)",
                  "shared_prefix": "--shared-prefix (use --prefix-len and --num-prefixes)"}


def _given(ctx: Optional[typer.Context], name: str) -> bool:
    source = ctx.get_parameter_source(name) if ctx is not None else None
    return source is not None and source.name == "COMMANDLINE"


def agent_config(ctx: Optional[typer.Context], conversations: Optional[int], turns: int, prefix_len: int,
                 num_prefixes: int, think_time: float, trace: Optional[Path]) -> Optional[AgentConfig]:
    """The agent workload when --conversations is given (from a JSONL trace with
    --prompts-file); options that would be silently ignored are refused instead."""
    if conversations is None:
        stray = [f"--{n.replace('_', '-')}" for n in AGENT_ONLY if _given(ctx, n)]
        if stray:
            raise BenchError(f"{', '.join(stray)} only apply with --conversations (the agent workload)")
        return None
    clash = [text for name, text in NOT_WITH_AGENT.items() if _given(ctx, name)]
    if trace is not None:
        clash += [f"--{n.replace('_', '-')} (the trace decides)" for n in AGENT_ONLY[:3] if _given(ctx, n)]
    if clash:
        raise BenchError(f"--conversations (the agent workload) does not take {'; '.join(clash)}")
    return AgentConfig(conversations=conversations, turns=turns, prefix_len=prefix_len,
                       num_prefixes=num_prefixes, think_time_s=think_time)


def command_line(ctx: Optional[typer.Context], command: str = "bench") -> str:
    """`tokenmill COMMAND` plus the arguments and options given on the command line, rebuilt
    from the parsed parameters (so it reads the same however the command was invoked); the
    API key is hidden because the command is written into reports."""
    if ctx is None:
        return shlex.join(["tokenmill", command, *sys.argv[1:]])
    parts = ["tokenmill", command]
    for param in ctx.command.params:
        name = param.name or ""
        source = ctx.get_parameter_source(name)
        if source is None or source.name != "COMMANDLINE":
            continue
        value = ctx.params.get(name)
        if param.param_type_name == "argument":
            parts.append(str(value))
            continue
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if getattr(param, "is_flag", False):
                if v:
                    parts.append(param.opts[0])
            else:
                parts += [param.opts[0], "***" if name == "api_key" else str(v)]
    return shlex.join(parts)
