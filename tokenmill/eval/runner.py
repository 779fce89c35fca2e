"""Ask one server every task of a suite over its HTTP API, then check the answers.

Requests are plain (non-streaming) chat completions, `concurrency` in flight, greedy
unless told otherwise. The run's machine time is its wall time from the first request
sent to the last answer received: the time it kept the server busy. Checking happens
after that, so the sandbox's work is never counted as the server's.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import httpx

from tokenmill.eval.checkers import Verdict, check
from tokenmill.eval.sandbox import Sandbox
from tokenmill.eval.suite import Suite, Task


class EvalError(RuntimeError):
    """The run could not happen (server unreachable, no model to ask)."""


@dataclass(frozen=True)
class Target:
    """One configuration under test: a server, the model to ask it for, a label."""

    label: str
    base_url: str
    model: Optional[str] = None  # None: the first of GET /v1/models
    api_key: Optional[str] = None

    def url(self, path: str) -> str:
        return self.base_url.rstrip("/").removesuffix("/v1") + "/v1" + path

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True)
class Settings:
    concurrency: int = 4
    temperature: float = 0.0
    seed: Optional[int] = None
    request_timeout_s: float = 300.0
    structured: bool = False  # send JSON tasks' schemas as response_format


@dataclass
class Answer:
    """One task's request and reply, and later its verdict."""

    task_id: str
    kind: str
    ok: bool = False  # the server answered (HTTP 200 with a choice)
    error: Optional[str] = None
    text: str = ""
    finish_reason: Optional[str] = None
    prompt_tokens: Optional[int] = None
    completion_tokens: Optional[int] = None
    cached_tokens: int = 0
    start_s: float = 0.0
    latency_s: float = 0.0
    passed: bool = False
    reason: str = ""
    check_error: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class TargetRun:
    target: Target
    model: str
    answers: list[Answer] = field(default_factory=list)
    busy_s: float = 0.0  # first request sent to last answer received


def discover_model(target: Target) -> str:
    try:
        resp = httpx.get(target.url("/models"), headers=target.headers(), timeout=30)
        resp.raise_for_status()
        models = resp.json().get("data") or []
    except (httpx.HTTPError, ValueError) as exc:
        raise EvalError(f"{target.label}: cannot list models at {target.url('/models')}: {exc}") from None
    if not models:
        raise EvalError(f"{target.label}: GET /v1/models lists no model; pass --model")
    return str(models[0]["id"])


def request_body(task: Task, model: str, settings: Settings) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": list(task.messages), "max_tokens": task.max_tokens,
                            "temperature": settings.temperature}
    if settings.seed is not None:
        body["seed"] = settings.seed
    if settings.structured and task.kind == "json":
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "answer", "schema": task.schema, "strict": True}}
    return body


async def _ask(client: httpx.AsyncClient, target: Target, model: str, task: Task, settings: Settings,
               t0: float) -> Answer:
    ans = Answer(task_id=task.id, kind=task.kind)
    start = time.perf_counter()
    ans.start_s = start - t0
    try:
        resp = await client.post(target.url("/chat/completions"), json=request_body(task, model, settings),
                                 headers=target.headers())
        if resp.status_code != 200:
            ans.error = f"http_{resp.status_code}: {resp.text[:200]}"
        else:
            data = resp.json()
            choice = (data.get("choices") or [None])[0]
            if not choice:
                ans.error = "no choice in the reply"
            else:
                ans.ok = True
                ans.text = (choice.get("message") or {}).get("content") or ""
                ans.finish_reason = choice.get("finish_reason")
            usage = data.get("usage") or {}
            ans.prompt_tokens = usage.get("prompt_tokens")
            ans.completion_tokens = usage.get("completion_tokens")
            ans.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    except (httpx.HTTPError, ValueError, TypeError, AttributeError) as exc:  # unreachable or a malformed reply
        ans.error = f"{type(exc).__name__}: {exc}"[:200]
    ans.latency_s = time.perf_counter() - start
    return ans


async def collect_answers(target: Target, model: str, suite: Suite, settings: Settings,
                          on_answer: Callable[[Answer], None] = lambda a: None) -> TargetRun:
    """Every task's answer, in suite order, and the time the server was kept busy."""
    sem = asyncio.Semaphore(settings.concurrency)
    limits = httpx.Limits(max_connections=settings.concurrency)
    async with httpx.AsyncClient(timeout=settings.request_timeout_s, limits=limits) as client:
        t0 = time.perf_counter()
        ends: list[float] = []

        async def one(task: Task) -> Answer:
            async with sem:
                ans = await _ask(client, target, model, task, settings, t0)
            ends.append(time.perf_counter())
            on_answer(ans)
            return ans

        answers = await asyncio.gather(*(one(t) for t in suite.tasks))
    return TargetRun(target=target, model=model, answers=list(answers), busy_s=max(ends) - t0)


def check_answers(run: TargetRun, suite: Suite, sandbox: Sandbox,
                  on_verdict: Callable[[Answer], None] = lambda a: None) -> None:
    """Judge each answer in place; a request that failed is a failed task."""
    for task, ans in zip(suite.tasks, run.answers):
        if not ans.ok:
            verdict = Verdict(False, f"no answer: {ans.error}")
        else:
            verdict = check(task, ans.text, sandbox)
        ans.passed, ans.reason, ans.check_error = verdict.passed, verdict.reason, verdict.error
        on_verdict(ans)


def run_target(target: Target, suite: Suite, settings: Settings, sandbox: Sandbox,
               on_answer: Callable[[Answer], None] = lambda a: None) -> TargetRun:
    model = target.model or discover_model(target)
    run = asyncio.run(collect_answers(target, model, suite, settings, on_answer))
    check_answers(run, suite, sandbox)
    return run
