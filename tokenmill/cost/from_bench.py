"""Self-hosted USD per million tokens from a measured benchmark run.

Method: a run kept the machine for `duration_s`, which at `usd_per_hour` cost
`machine_usd = usd_per_hour * duration_s / 3600`. That bill is split between the
run's input and output tokens by the share of time requests spent before their first
token:

    prefill_share = mean TTFT / mean end-to-end latency
    USD per 1M input  = machine_usd * prefill_share       / input_tokens_total  * 1e6
    USD per 1M output = machine_usd * (1 - prefill_share) / output_tokens_total * 1e6

Why: the requests in flight share the machine, so over a run the machine-time a
request's prefill phase occupies is proportional to its TTFT, and its decode phase to
the rest of its latency. A request with the run's average token counts is then
charged exactly the run's machine cost per request, so the two prices reproduce the
bill. Caveats: TTFT includes queueing, so an overloaded run over-charges input; with
chunked prefill a step mixes both phases. Without TTFT and E2E figures the whole bill
goes to output tokens (input priced 0), reported as the fallback method. The
"all-to-output" price is always shown too: the simple upper bound on output cost.

Machine time is billed whole: idle time in a run that did not saturate the machine
is charged to the tokens it did serve, as it would be on a rented machine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from decimal import Decimal, localcontext
from pathlib import Path
from typing import Any

from tokenmill.cost.cards import MILLION, SECONDS_PER_HOUR
from tokenmill.cost.values import ConfigError, Fields, to_decimal

METHOD_SPLIT = "ttft/e2e split"
METHOD_FALLBACK = "all to output (no ttft/e2e)"


class BenchResultsError(ConfigError):
    """A benchmark results file is missing what the conversion needs."""


@dataclass(frozen=True)
class BenchRun:
    """The figures of one run that pricing uses; the rest of the run is ignored."""

    label: str
    duration_s: Decimal
    input_tokens_total: int
    output_tokens_total: int
    num_ok: int | None = None
    mode: str = ""
    concurrency: Any = None
    ttft_mean_ms: Decimal | None = None
    e2e_mean_ms: Decimal | None = None


@dataclass(frozen=True)
class BenchRates:
    """One run priced on a machine at `usd_per_hour`."""

    run: BenchRun
    usd_per_hour: Decimal
    machine_usd: Decimal
    prefill_share: Decimal
    usd_per_mtok_input: Decimal
    usd_per_mtok_output: Decimal
    usd_per_mtok_output_all: Decimal  # the whole bill on output tokens
    method: str

    @property
    def usd_per_request(self) -> Decimal | None:
        ok = self.run.num_ok
        return self.machine_usd / ok if ok else None


def parse_runs(data: Any, where: str = "bench results") -> list[BenchRun]:
    """Runs from a parsed results document; extra keys are ignored, missing ones named."""
    top = Fields(data, where, BenchResultsError)
    runs = top.raw("runs")
    if not isinstance(runs, list) or not runs:
        raise top.fail("'runs' must be a non-empty list")
    out = []
    for i, raw in enumerate(runs):
        label = raw.get("label") if isinstance(raw, dict) else None
        f = Fields(raw, f"{where}: run {i}" + (f" ({label!r})" if label else ""), BenchResultsError)
        out.append(BenchRun(
            label=str(label) if label else f"run {i}",
            duration_s=f.number("duration_s", positive=True),
            input_tokens_total=f.integer("input_tokens_total"),
            output_tokens_total=f.integer("output_tokens_total"),
            num_ok=f.integer("num_ok") if f.has("num_ok") else None,
            mode=str(raw.get("mode") or ""),
            concurrency=raw.get("concurrency"),
            ttft_mean_ms=_mean(f, "ttft_ms"),
            e2e_mean_ms=_mean(f, "e2e_ms")))
    return out


def _mean(f: Fields, key: str) -> Decimal | None:
    sub = f.sub(key)
    if sub is None or not sub.has("mean"):
        return None
    return sub.number("mean")


def load_runs(path: str | Path) -> list[BenchRun]:
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"), parse_float=Decimal)
    except FileNotFoundError:
        raise BenchResultsError(f"bench results {path}: no such file") from None
    except json.JSONDecodeError as exc:
        raise BenchResultsError(f"bench results {path}: not JSON: {exc}") from None
    return parse_runs(data, f"bench results {path.name}")


def price_run(run: BenchRun, usd_per_hour: Decimal | float | str) -> BenchRates:
    """Self-hosted prices for one run (method in the module doc)."""
    rate = to_decimal(usd_per_hour)
    if rate < 0:
        raise BenchResultsError(f"--usd-per-hour must be >= 0, got {usd_per_hour}")
    with localcontext(prec=40):
        machine_usd = rate * run.duration_s / SECONDS_PER_HOUR
        if run.ttft_mean_ms is not None and run.e2e_mean_ms:
            share = min(Decimal(1), max(Decimal(0), run.ttft_mean_ms / run.e2e_mean_ms))
            method = METHOD_SPLIT
        else:
            share, method = Decimal(0), METHOD_FALLBACK
        return BenchRates(
            run=run, usd_per_hour=rate, machine_usd=machine_usd, prefill_share=share,
            usd_per_mtok_input=_per_mtok(machine_usd * share, run.input_tokens_total),
            usd_per_mtok_output=_per_mtok(machine_usd * (1 - share), run.output_tokens_total),
            usd_per_mtok_output_all=_per_mtok(machine_usd, run.output_tokens_total),
            method=method)


def _per_mtok(usd: Decimal, tokens: int) -> Decimal:
    if tokens == 0:
        # No tokens of this kind: there is nothing to charge, or no way to charge it.
        return Decimal(0) if usd == 0 else Decimal("Infinity")
    return usd / tokens * MILLION
