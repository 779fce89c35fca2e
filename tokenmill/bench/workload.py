"""What to send: the list of requests of a benchmark run, built reproducibly from a seed.

A workload is either synthetic (prompts of random common English words with input and
output lengths drawn from a distribution, the first part optionally shared by every
request), read from a JSONL file of real prompts, or multi-turn agent conversations
(`AgentConfig`, built and replayed by `bench.agent`: each turn's prompt is the previous
turn's prompt, the server's answer and a new user message). The same seed gives the same
prompts, lengths and (for open-loop runs) the same Poisson arrival times; each run of a
sweep gets its own synthetic prompts, so no run is served from another's cache.

Synthetic prompts need no tokenizer: every word in `WORDS` is a single token, with its
leading space, in GPT-2-style BPE vocabularies (SmolLM2's included), so a prompt of N
words is about N tokens. The server's `usage.prompt_tokens` is what gets reported.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

Dist = Literal["fixed", "uniform", "normal"]

# Frequent English words; each is one BPE token with its leading space.
WORDS: tuple[str, ...] = tuple(dict.fromkeys("""
the of and to in is was for that on as with by he at from his it an were are which be this
has had not but one have first they new or after who their its also two all been more when
there time she other would can into her over may only most three years some such well where
about then up out world state part him many year made city during used these so between
under about later most known through since four early while called people being same both
several then before would work during second group back life war film high number team area
house family south north west east school game over long music next last name line place
water world book road day night home hand word light point car land power river town case
end field form fact line order side head eye week king money sea story face center child
""".split()))


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution: `mean` and a relative `spread`.

    fixed: always `mean`; uniform: integers in [mean*(1-spread), mean*(1+spread)];
    normal: mean `mean`, standard deviation `mean*spread`. Draws are clipped to >= 1.
    """

    mean: int
    kind: Dist = "fixed"
    spread: float = 0.25

    def __post_init__(self) -> None:
        if self.mean < 1:
            raise ValueError(f"length must be >= 1, got {self.mean}")
        if self.kind not in ("fixed", "uniform", "normal"):
            raise ValueError(f"unknown length distribution {self.kind!r}")
        if not 0.0 <= self.spread <= 1.0:
            raise ValueError(f"spread must be in [0, 1], got {self.spread}")

    def draw(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return self.mean
        if self.kind == "uniform":
            lo = max(1, round(self.mean * (1 - self.spread)))
            hi = max(lo, round(self.mean * (1 + self.spread)))
            return rng.randint(lo, hi)
        return max(1, round(rng.gauss(self.mean, self.mean * self.spread)))


@dataclass(frozen=True)
class AgentConfig:
    """Multi-turn agent conversations: `conversations` of `turns` each; every prompt starts
    with one of `num_prefixes` shared system prompts of `prefix_len` tokens (a tool
    catalogue, say), then the conversation's history and a new user message (of the
    workload's input length; answers of its output length). A conversation's next turn
    goes out when its previous answer is back, after a think time drawn exponentially
    with mean `think_time_s` (0: none)."""

    conversations: int = 16
    turns: int = 4
    prefix_len: int = 1500
    num_prefixes: int = 1
    think_time_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("conversations", "turns", "prefix_len", "num_prefixes"):
            if getattr(self, name) < 1:
                raise ValueError(f"agent {name} must be >= 1, got {getattr(self, name)}")
        if self.think_time_s < 0:
            raise ValueError(f"think time must be >= 0, got {self.think_time_s}")

    @property
    def num_requests(self) -> int:
        return self.conversations * self.turns


@dataclass(frozen=True)
class WorkloadConfig:
    """Everything that decides the requests, resolved once from the command line."""

    input_len: LengthDist = field(default_factory=lambda: LengthDist(128))
    output_len: LengthDist = field(default_factory=lambda: LengthDist(64))
    shared_prefix: float = 0.0  # fraction of each synthetic prompt identical across requests
    prompts_file: Optional[Path] = None
    seed: int = 0
    agent: Optional[AgentConfig] = None  # set: multi-turn conversations instead of single requests

    def __post_init__(self) -> None:
        if not 0.0 <= self.shared_prefix <= 1.0:
            raise ValueError(f"shared prefix fraction must be in [0, 1], got {self.shared_prefix}")


@dataclass(frozen=True)
class RequestSpec:
    """One request to send. `prompt` for /v1/completions, `messages` for chat (one of them
    may be derived from the other by the client). `input_len` is the intended prompt
    length in tokens (approximate for synthetic prompts, None for files)."""

    index: int
    prompt: str
    max_tokens: int
    input_len: Optional[int] = None
    messages: Optional[list[dict[str, Any]]] = None
    conversation: Optional[int] = None  # agent workload: which conversation, which turn (from 0)
    turn: Optional[int] = None


def _words(rng: random.Random, n: int) -> list[str]:
    return [rng.choice(WORDS) for _ in range(n)]


def synthetic_requests(cfg: WorkloadConfig, n: int, run_index: int = 0) -> list[RequestSpec]:
    """`n` synthetic requests for run `run_index` of a sweep. Each run draws its own
    prompts (from a stream derived from the seed and the run index), so a server's
    prefix cache cannot serve one run from an earlier run's prompts; the shared prefix
    comes from its own stream and is the same for every request of every run."""
    rng = random.Random(f"{cfg.seed}:{run_index}")
    prefix_rng = random.Random(f"{cfg.seed}-prefix")
    # The longest prompt any request can have bounds the prefix we may need.
    longest = max(1, round(cfg.input_len.mean * (1 + cfg.input_len.spread) * 3))
    prefix_pool = _words(prefix_rng, longest)
    out = []
    for i in range(n):
        in_len = cfg.input_len.draw(rng)
        out_len = cfg.output_len.draw(rng)
        k = min(round(in_len * cfg.shared_prefix), len(prefix_pool))
        words = prefix_pool[:k] + _words(rng, in_len - k)
        text = " ".join(words)
        out.append(RequestSpec(index=i, prompt=text, max_tokens=out_len, input_len=in_len))
    return out


def file_requests(cfg: WorkloadConfig, n: int) -> list[RequestSpec]:
    """`n` requests from a JSONL file, taken in file order and cycled if the file is short.

    Each line is an object with `prompt` (or `text`) or chat `messages`, and optionally
    `max_tokens` (or `output_len`); without one the output length distribution is drawn.
    """
    assert cfg.prompts_file is not None
    rows: list[dict[str, Any]] = []
    with open(cfg.prompts_file, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{cfg.prompts_file}:{lineno}: not JSON: {exc}") from exc
            if not isinstance(row, dict) or not ({"prompt", "text", "messages"} & row.keys()):
                raise ValueError(f"{cfg.prompts_file}:{lineno}: needs 'prompt', 'text' or 'messages'")
            if "messages" in row and not (isinstance(row["messages"], list)
                                          and all(isinstance(m, dict) for m in row["messages"])):
                raise ValueError(f"{cfg.prompts_file}:{lineno}: 'messages' must be a list of objects")
            rows.append(row)
    if not rows:
        raise ValueError(f"{cfg.prompts_file}: no prompts")
    rng = random.Random(cfg.seed)
    out = []
    for i in range(n):
        row = rows[i % len(rows)]
        messages = row.get("messages")
        prompt = row.get("prompt", row.get("text"))
        if prompt is None:
            prompt = "\n".join(str(m.get("content", "")) for m in messages or [])
        max_tokens = row.get("max_tokens", row.get("output_len")) or cfg.output_len.draw(rng)
        out.append(RequestSpec(index=i, prompt=str(prompt), max_tokens=int(max_tokens), messages=messages))
    return out


def build_requests(cfg: WorkloadConfig, n: int, run_index: int = 0) -> list[RequestSpec]:
    """The requests of run `run_index` (warm-up: -1). Synthetic runs get fresh prompts of
    the same distributions; a prompts file is replayed in order by every run."""
    return file_requests(cfg, n) if cfg.prompts_file else synthetic_requests(cfg, n, run_index)


def poisson_arrivals(rate: float, n: int, seed: int) -> list[float]:
    """Send times (seconds from the start) of `n` requests at Poisson rate `rate`/s:
    exponential inter-arrival gaps from a seeded stream; the first request goes at 0."""
    if rate <= 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    rng = random.Random(f"{seed}-arrivals-{rate}")
    t, out = 0.0, []
    for i in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out
