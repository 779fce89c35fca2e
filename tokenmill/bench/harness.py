"""The benchmark as a library call: config in, results dict (the results.json shape) out.

`run_benchmark` checks the target is loopback (unless allowed), finds the model id if
none was given, sends optional warm-up requests, then runs every sweep point in turn
(closed-loop concurrencies first, then open-loop rates), each with fresh prompts drawn
from the same distributions (see workload.build_requests); an agent workload runs each
concurrency as that many conversations at a time, each run with its own conversations
(see agent.build_conversations).
It talks HTTP only; nothing here imports the engine or the model.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import os
import platform
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional
from urllib.parse import urlsplit

import httpx

from tokenmill.bench.agent import build_conversations
from tokenmill.bench.client import ClientConfig, RequestRecord, send_request
from tokenmill.bench.runner import RunOutcome, RunSpec, make_client, run_conversations, run_once
from tokenmill.bench.stats import Slo, run_summary
from tokenmill.bench.workload import WorkloadConfig, build_requests, synthetic_requests

HARNESS_VERSION = 1


class BenchError(Exception):
    """A benchmark that cannot start (bad target, no model); the message is for users."""


@dataclass(frozen=True)
class BenchConfig:
    """A whole benchmark: where, what, and which sweep points."""

    client: ClientConfig
    workload: WorkloadConfig
    runs: tuple[RunSpec, ...]
    slo: Slo = field(default_factory=Slo)
    warmup: int = 1
    command: str = ""


def is_loopback(base_url: str) -> bool:
    """True for localhost and 127.0.0.0/8 / ::1 literals. Other names are not resolved:
    a name that happens to resolve to loopback today is not a loopback target."""
    host = urlsplit(base_url).hostname or ""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_target(base_url: str, allow_remote: bool) -> None:
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BenchError(f"--base-url must be an http(s) URL, got {base_url!r}")
    if not allow_remote and not is_loopback(base_url):
        raise BenchError(f"refusing non-loopback target {parts.hostname!r}; pass --allow-remote "
                         "to benchmark a server on another host")


def discover_model(base_url: str, api_key: Optional[str], timeout_s: float = 10.0) -> str:
    """The first model id from GET /v1/models."""
    url = base_url.rstrip("/").removesuffix("/v1") + "/v1/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(url, headers=headers, timeout=timeout_s, trust_env=False)
        resp.raise_for_status()
        return str(resp.json()["data"][0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise BenchError(f"could not read a model id from {url} ({exc}); pass --model") from exc


def describe_workload(w: WorkloadConfig) -> str:
    a = w.agent
    if a is not None and w.prompts_file:
        src = f"agent: the first {a.conversations} conversations of {w.prompts_file}"
    elif a is not None:
        think = f", think time mean {a.think_time_s:g} s" if a.think_time_s else ""
        src = (f"agent: {a.conversations} conversations x {a.turns} turns, {a.num_prefixes} shared "
               f"prefix{'es' if a.num_prefixes > 1 else ''} of {a.prefix_len} tokens{think}; "
               f"user messages {w.input_len.kind} mean {w.input_len.mean} tokens")
    elif w.prompts_file:
        src = f"prompts from {w.prompts_file}"
    else:
        src = (f"synthetic, input {w.input_len.kind} mean {w.input_len.mean} tokens"
               + (f" (spread {w.input_len.spread:g})" if w.input_len.kind != "fixed" else "")
               + f", shared prefix {w.shared_prefix:.0%}")
    out = w.output_len
    return (f"{src}; output {out.kind} mean {out.mean} tokens"
            + (f" (spread {out.spread:g})" if out.kind != "fixed" else ""))


def _meta(cfg: BenchConfig) -> dict[str, Any]:
    c, w = cfg.client, cfg.workload
    return {
        "base_url": c.base_url, "model": c.model, "endpoint": c.endpoint, "seed": w.seed,
        "started_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": cfg.command, "harness_version": HARNESS_VERSION,
        "ignore_eos": c.ignore_eos, "temperature": c.temperature,
        "workload": {
            "input_len": asdict(w.input_len), "output_len": asdict(w.output_len),
            "shared_prefix": w.shared_prefix,
            "prompts_file": str(w.prompts_file) if w.prompts_file else None,
            "agent": asdict(w.agent) if w.agent else None,
        },
        "workload_desc": describe_workload(w),
        "slo": {"ttft_ms": cfg.slo.ttft_ms, "itl_ms": cfg.slo.itl_ms, "itl_statistic": "mean"},
        "warmup_requests": cfg.warmup,
        "client_host": {"platform": platform.platform(), "cpus": os.cpu_count(),
                        "python": platform.python_version()},
    }


async def _warmup(cfg: BenchConfig) -> list[RequestRecord]:
    """Warm-up requests (not recorded): the first request to a server often pays for
    lazy initialization that is no part of steady-state serving."""
    if cfg.warmup <= 0:
        return []
    # an agent workload warms up on one-turn synthetic prompts (its prompts file is a trace)
    w = cfg.workload
    reqs = synthetic_requests(w, cfg.warmup, run_index=-1) if w.agent else build_requests(w, cfg.warmup, run_index=-1)
    async with make_client(cfg.client, 1) as client:
        return [await send_request(client, cfg.client, r, 0.0) for r in reqs]


# Progress hooks: start(label, total) and advance(record); see cli.RichProgress.
StartHook = Callable[[str, int], None]
DoneHook = Callable[[RequestRecord], None]


async def run_benchmark_async(cfg: BenchConfig, on_start: Optional[StartHook] = None,
                              on_done: Optional[DoneHook] = None) -> dict[str, Any]:
    meta = _meta(cfg)
    warm = await _warmup(cfg)
    meta["warmup_errors"] = sum(1 for r in warm if not r.ok)
    runs = []
    for k, spec in enumerate(cfg.runs):
        if on_start:
            on_start(spec.label, spec.num_requests)
        outcome: RunOutcome
        if cfg.workload.agent:
            conversations = build_conversations(cfg.workload, run_index=k)
            outcome = await run_conversations(cfg.client, spec, conversations, on_done)
        else:
            requests = build_requests(cfg.workload, spec.num_requests, run_index=k)
            outcome = await run_once(cfg.client, spec, requests, cfg.workload.seed, on_done)
        runs.append(run_summary(outcome, cfg.slo))
    return {"meta": meta, "runs": runs}


def run_benchmark(cfg: BenchConfig, on_start: Optional[StartHook] = None,
                  on_done: Optional[DoneHook] = None) -> dict[str, Any]:
    """Run the whole benchmark (blocking) and return the results dict."""
    return asyncio.run(run_benchmark_async(cfg, on_start, on_done))
