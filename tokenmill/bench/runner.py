"""Drive the load: a closed loop at fixed concurrency, or an open loop of Poisson arrivals;
for the agent workload, a closed loop of conversations (`run_conversations`).

Both are bounded twice: by a request count and by a duration. After `duration_s` no new
request is started; requests already in flight are awaited (each is bounded by the
client's request timeout), so the measured duration is from the first send to the last
completion. Requests never started are simply not part of the run.

Connections are opened before a run's clock starts (see `preconnect`), so TTFT is the
server's, not TCP set-up's: a long-lived client keeps its connections pooled.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Callable, Literal, Optional

import httpx

from tokenmill.bench.agent import Conversation
from tokenmill.bench.client import ClientConfig, RequestRecord, send_request
from tokenmill.bench.workload import RequestSpec, poisson_arrivals

Mode = Literal["closed", "open"]
OnDone = Callable[[RequestRecord], None]
MAX_PRECONNECT = 64


@dataclass(frozen=True)
class RunSpec:
    """One point of a sweep. Closed: `concurrency` workers, each sending its next request
    as soon as its previous one ends. Open: requests sent at Poisson `request_rate`/s
    whatever the server's progress (in flight: unbounded unless `max_concurrency`)."""

    mode: Mode
    num_requests: int
    duration_s: Optional[float] = None
    concurrency: Optional[int] = None
    request_rate: Optional[float] = None
    max_concurrency: Optional[int] = None

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError("num_requests must be >= 1")
        if self.mode == "closed" and (self.concurrency is None or self.concurrency < 1):
            raise ValueError("a closed-loop run needs concurrency >= 1")
        if self.mode == "open" and (self.request_rate is None or self.request_rate <= 0):
            raise ValueError("an open-loop run needs request_rate > 0")

    @property
    def label(self) -> str:
        return f"c={self.concurrency}" if self.mode == "closed" else f"rate={self.request_rate:g}/s"


@dataclass
class RunOutcome:
    """The raw result of one run: records in send order and the wall time it took."""

    spec: RunSpec
    records: list[RequestRecord]
    duration_s: float


def make_client(cfg: ClientConfig, max_in_flight: int) -> httpx.AsyncClient:
    """One pooled client per run. trust_env=False: proxy variables must never route
    loopback benchmark traffic elsewhere."""
    limits = httpx.Limits(max_connections=max_in_flight, max_keepalive_connections=max_in_flight)
    timeout = httpx.Timeout(cfg.request_timeout_s, connect=min(30.0, cfg.request_timeout_s))
    return httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False)


async def preconnect(client: httpx.AsyncClient, cfg: ClientConfig, n: int) -> None:
    """Open up to `n` pooled connections before the clock starts, with concurrent cheap
    GET /v1/models requests (any answer will do), so TTFT measures the server rather
    than TCP set-up, as it would for a long-lived client. Failures are ignored: the run
    itself will report them."""
    url = cfg.url().rsplit("/", 1)[0].removesuffix("/chat") + "/models"

    async def one() -> None:
        try:
            await client.get(url, headers=cfg.headers(), timeout=5.0)
        except httpx.HTTPError:
            pass

    await asyncio.gather(*(one() for _ in range(n)))


async def _closed(client: httpx.AsyncClient, cfg: ClientConfig, spec: RunSpec,
                  requests: list[RequestSpec], deadline: float, t0: float,
                  on_done: Optional[OnDone]) -> list[RequestRecord]:
    records: list[RequestRecord] = []
    next_i = 0  # shared cursor; safe without a lock: asyncio switches only at awaits

    async def worker() -> None:
        nonlocal next_i
        while next_i < spec.num_requests and time.perf_counter() < deadline:
            req = requests[next_i]
            next_i += 1
            rec = await send_request(client, cfg, req, t0)
            records.append(rec)
            if on_done:
                on_done(rec)

    assert spec.concurrency is not None
    await asyncio.gather(*(worker() for _ in range(spec.concurrency)))
    return records


async def _open(client: httpx.AsyncClient, cfg: ClientConfig, spec: RunSpec,
                requests: list[RequestSpec], deadline: float, t0: float, seed: int,
                on_done: Optional[OnDone]) -> list[RequestRecord]:
    assert spec.request_rate is not None
    arrivals = poisson_arrivals(spec.request_rate, spec.num_requests, seed)
    gate = asyncio.Semaphore(spec.max_concurrency) if spec.max_concurrency else None
    records: list[RequestRecord] = []

    async def one(req: RequestSpec) -> None:
        if gate:
            async with gate:
                rec = await send_request(client, cfg, req, t0)
        else:
            rec = await send_request(client, cfg, req, t0)
        records.append(rec)
        if on_done:
            on_done(rec)

    tasks = []
    for req, at in zip(requests, arrivals):
        send_at = t0 + at
        if send_at >= deadline:
            break
        delay = send_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(req)))
    await asyncio.gather(*tasks)
    return records


async def _conversations(client: httpx.AsyncClient, cfg: ClientConfig, spec: RunSpec,
                         conversations: list[Conversation], deadline: float, t0: float,
                         on_done: Optional[OnDone]) -> list[RequestRecord]:
    records: list[RequestRecord] = []
    next_c = sent = 0  # shared cursors; safe without a lock: asyncio switches only at awaits

    def more() -> bool:
        return sent < spec.num_requests and time.perf_counter() < deadline

    async def converse(conv: Conversation) -> None:
        nonlocal sent
        answers: list[str] = []
        for k, turn in enumerate(conv.turns):
            if turn.think_s and more():
                await asyncio.sleep(turn.think_s)
            if not more():
                return
            sent += 1
            text: list[str] = []
            rec = await send_request(client, cfg, conv.request(k, answers), t0, text)
            records.append(rec)
            if on_done:
                on_done(rec)
            if not rec.ok:
                return  # without its answer the conversation has no history to go on with
            answers.append("".join(text))

    async def worker() -> None:
        nonlocal next_c
        while next_c < len(conversations) and more():
            next_c += 1
            await converse(conversations[next_c - 1])

    assert spec.concurrency is not None
    await asyncio.gather(*(worker() for _ in range(spec.concurrency)))
    return records


async def run_conversations(cfg: ClientConfig, spec: RunSpec, conversations: list[Conversation],
                            on_done: Optional[OnDone] = None) -> RunOutcome:
    """Replay `conversations` in a closed loop: `spec.concurrency` of them at a time, each
    turn sent when the conversation's previous answer is back (and its think time has
    passed), the next conversation started when one ends. A conversation whose turn fails
    ends there. Bounded by `spec.num_requests` turns and `spec.duration_s`."""
    if spec.mode != "closed":
        raise ValueError("conversations run in a closed loop (a concurrency, not a request rate)")
    assert spec.concurrency is not None
    async with make_client(cfg, spec.concurrency) as client:
        await preconnect(client, cfg, min(spec.concurrency, MAX_PRECONNECT))
        t0 = time.perf_counter()
        deadline = t0 + spec.duration_s if spec.duration_s else float("inf")
        records = await _conversations(client, cfg, spec, conversations, deadline, t0, on_done)
        duration = time.perf_counter() - t0
    records.sort(key=lambda r: r.index)
    return RunOutcome(spec=spec, records=records, duration_s=duration)


async def run_once(cfg: ClientConfig, spec: RunSpec, requests: list[RequestSpec], seed: int = 0,
                   on_done: Optional[OnDone] = None) -> RunOutcome:
    """Run one sweep point against the server; `requests` must hold >= num_requests."""
    if len(requests) < spec.num_requests:
        raise ValueError(f"need {spec.num_requests} requests, got {len(requests)}")
    in_flight = spec.concurrency or spec.max_concurrency or spec.num_requests
    async with make_client(cfg, max(1, in_flight)) as client:
        await preconnect(client, cfg, min(max(1, in_flight), MAX_PRECONNECT))
        t0 = time.perf_counter()
        deadline = t0 + spec.duration_s if spec.duration_s else float("inf")
        if spec.mode == "closed":
            records = await _closed(client, cfg, spec, requests, deadline, t0, on_done)
        else:
            records = await _open(client, cfg, spec, requests, deadline, t0, seed, on_done)
        duration = time.perf_counter() - t0
    records.sort(key=lambda r: r.index)
    return RunOutcome(spec=spec, records=records, duration_s=duration)
