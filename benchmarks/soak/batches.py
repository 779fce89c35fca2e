"""Small Batch API jobs beside the live traffic (openai SDK): each line a checked greedy
chat request, so the output file is judged as the live answers are: every custom_id
answered exactly once, each answer the reference's."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from benchmarks.soak.traffic import ENGINE_FAULT_CODES, Client, Outcome, answer_of, error_code

FINAL = ("completed", "failed", "expired", "cancelled")
POLL_S = 1.0


def lines_for(client: Client, tag: str, n: int) -> tuple[bytes, dict[str, int]]:
    """The input file and custom_id -> prompt index."""
    which, out = {}, []
    for j in range(n):
        i = client.rng.randrange(client.prompts)
        cid = f"{tag}-{j}"
        which[cid] = i
        out.append({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                    "body": client.bodies[("chat", i)][1]})
    return b"".join(json.dumps(x).encode() + b"\n" for x in out), which


async def one_batch(client: Client, sdk: Any, tag: str, n: int, deadline: float) -> Outcome:
    """Submit one batch of `n` lines, follow it to a final status (or `deadline`), judge it."""
    ledger = client.ledger
    ledger.started += 1
    ledger.open += 1
    o = Outcome("batch", "batch", time.monotonic(), 0.0, "no_terminal")
    try:
        data, which = lines_for(client, tag, n)
        f = await sdk.files.create(file=(f"{tag}.jsonl", data), purpose="batch")
        b = await sdk.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        while b.status not in FINAL and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
            b = await sdk.batches.retrieve(b.id)
        if b.status not in FINAL:
            o.detail = f"{b.id} still {b.status} at the end"
            return o
        if b.status != "completed":
            o.status, o.detail = f"batch_{b.status}", f"{b.id}: {b.errors}"
            return o
        o.status, o.detail = judge(client, which, await _lines(sdk, b.output_file_id),
                                   await _lines(sdk, b.error_file_id))
        o.detail = f"{b.id}: {o.detail}"
        return o
    except asyncio.CancelledError:
        o.detail = "still running when the soak ended"
        raise
    except Exception as exc:  # the SDK's errors: a refused upload or poll is this batch's outcome
        o.status, o.detail = "batch_error", f"{type(exc).__name__}: {str(exc)[:200]}"
        return o
    finally:
        o.end = time.monotonic()
        ledger.open -= 1
        ledger.outcomes.append(o)


async def _lines(sdk: Any, file_id: str | None) -> list[dict[str, Any]]:
    if not file_id:
        return []
    text = (await sdk.files.content(file_id)).text
    return [json.loads(x) for x in text.splitlines() if x.strip()]


def judge(client: Client, which: dict[str, int], out: list[dict], errors: list[dict]) -> tuple[str, str]:
    """Every line answered exactly once (output and error files together), each answer the
    reference's; returns (status, detail)."""
    seen: dict[str, int] = {}
    for rec in out + errors:
        seen[rec.get("custom_id")] = seen.get(rec.get("custom_id"), 0) + 1
    twice = [c for c, k in seen.items() if k > 1]
    if twice:
        return "duplicate", f"lines answered more than once: {twice}"
    missing = sorted(set(which) - set(seen))
    if missing or set(seen) - set(which):
        return "no_terminal", f"lines never answered: {missing}; unknown: {sorted(set(seen) - set(which))}"
    failed = errors + [rec for rec in out if (rec.get("response") or {}).get("status_code") != 200]
    if failed:
        # A line the engine's death kept from running: the server re-runs it a few times
        # (tokenmill/batch/runner.py max_attempts), then fails it with this code. Expected
        # only if the batch overlapped a fault (faults.settle decides).
        codes = {error_code((rec.get("response") or {}).get("body") or rec) for rec in failed}
        status = "engine_fault" if codes <= set(ENGINE_FAULT_CODES) else "batch_line_error"
        return status, f"{len(failed)} of {len(which)} lines failed: {json.dumps(failed[0])[:300]}"
    for rec in out:
        resp = rec.get("response") or {}
        i = which[rec["custom_id"]]
        got = answer_of("/v1/chat/completions", resp["body"].get("choices") or [])
        if got != client.refs[("chat", i)]:
            return "wrong_answer", f"line {rec['custom_id']} chat#{i}: {got!r}, reference {client.refs[('chat', i)]!r}"
        if client.ledger.seen(resp["body"].get("id")):
            return "duplicate", f"response id {resp['body'].get('id')} came back twice"
    return "ok", f"{len(out)} lines"
