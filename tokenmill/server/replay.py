"""`tokenmill replay ID`: run a captured request (tokenmill/server/capture.py) again
through a server's HTTP API and say whether its output tokens are the same.

The replay is a /v1/completions request of the captured prompt token ids with every
resolved parameter spelled out (so the server's generation defaults play no part), its
seed included, asking for the output token ids (`return_token_ids`). In the exact mode
(`--dtype float32`) greedy and seeded sampled outputs do not depend on batching or
cache hits, so a replay on the same snapshot is identical token for token; a changed
snapshot (quantization, template, weights...) shows as the first differing token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx

from tokenmill.server.capture import Captured

# ResolvedParams fields the completions API takes as they are
_PASSED = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens",
           "skip_special_tokens", "include_stop_str_in_output", "logit_bias", "speculative")
_STRUCTURED = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice", "grammar": "guided_grammar"}


class ReplayError(RuntimeError):
    """The capture cannot be replayed, or the server refused it."""


@dataclass
class ChoiceDiff:
    prompt: int
    index: int
    captured: list[int]
    replayed: list[int]

    @property
    def first_difference(self) -> int | None:
        """The index of the first output token that differs (None: identical)."""
        if self.captured == self.replayed:
            return None
        for i, (a, b) in enumerate(zip(self.captured, self.replayed)):
            if a != b:
                return i
        return min(len(self.captured), len(self.replayed))

    def as_dict(self) -> dict[str, Any]:
        j = self.first_difference
        out: dict[str, Any] = {"prompt": self.prompt, "index": self.index, "tokens": len(self.captured),
                               "identical": j is None}
        if j is not None:
            out.update(first_difference=j, captured_token=_at(self.captured, j), replayed_token=_at(self.replayed, j))
        return out


def _at(ids: list[int], j: int) -> int | None:
    return ids[j] if j < len(ids) else None  # None: that side had ended


@dataclass
class ReplayReport:
    capture_id: str
    captured_snapshot: str
    replayed_snapshot: str | None
    choices: list[ChoiceDiff] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return all(c.first_difference is None for c in self.choices)

    def first_difference(self) -> ChoiceDiff | None:
        return next((c for c in self.choices if c.first_difference is not None), None)

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.capture_id, "identical": self.identical,
                "snapshot": {"captured": self.captured_snapshot, "replayed": self.replayed_snapshot},
                "choices": [c.as_dict() for c in self.choices]}

    def summary(self) -> str:
        snap = ("same snapshot" if self.captured_snapshot == self.replayed_snapshot else
                f"snapshot {self.captured_snapshot} -> {self.replayed_snapshot}")
        d = self.first_difference()
        if d is None:
            tokens = sum(len(c.captured) for c in self.choices)
            return f"{self.capture_id}: identical ({len(self.choices)} choices, {tokens} tokens; {snap})"
        j = d.first_difference
        return (f"{self.capture_id}: differs at token {j} of prompt {d.prompt} choice {d.index}: captured "
                f"{_at(d.captured, j)}, replayed {_at(d.replayed, j)} ({snap})")


def completion_body(c: Captured, model: str) -> dict[str, Any]:
    """The /v1/completions body that runs the captured request again."""
    p = c.params
    if p.get("thinking_token_budget") is not None:
        raise ReplayError(f"{c.id} ran under a thinking budget, which /v1/completions cannot set")
    body: dict[str, Any] = {"model": model, "prompt": c.prompts[0] if len(c.prompts) == 1 else c.prompts,
                            "return_token_ids": True, "stream": False}
    body.update({k: p[k] for k in _PASSED if p.get(k) is not None})
    for k in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        body[k] = float(body[k])
    s = p.get("structured")
    if s is not None:
        if s["kind"] == "json_object":
            body["response_format"] = {"type": "json_object"}
        else:
            body[_STRUCTURED[s["kind"]]] = s["value"]
    return body


def replay(c: Captured, base_url: str, api_key: str | None = None, model: str | None = None,
           timeout: float = 600.0) -> ReplayReport:
    """Run capture `c` on the server at `base_url` (`model`: the name to ask for; default
    the captured snapshot's name, unpinned, so a changed snapshot answers and shows how
    it differs)."""
    name = model or c.snapshot.split("@", 1)[0]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/")
    if not url.endswith("/v1"):
        url += "/v1"
    try:
        r = httpx.post(url + "/completions", json=completion_body(c, name), headers=headers, timeout=timeout)
    except httpx.HTTPError as exc:
        raise ReplayError(f"could not reach {url}: {exc}") from None
    if r.status_code != 200:
        raise ReplayError(f"the server refused the replay ({r.status_code}): {r.text[:500]}")
    body = r.json()
    n = int(c.params["n"])
    got = {ch["index"]: ch.get("token_ids") for ch in body["choices"]}
    if any(v is None for v in got.values()):
        raise ReplayError("the server does not return token ids (return_token_ids): is it tokenmill?")
    report = ReplayReport(c.id, c.snapshot, body.get("system_fingerprint"))
    for p, outs in enumerate(c.outputs):
        for i, ids in enumerate(outs):
            report.choices.append(ChoiceDiff(p, i, ids, got.get(p * n + i, [])))
    return report
