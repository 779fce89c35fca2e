"""The multi-turn agent workload: conversations built from a seed, each turn's request
built from the conversation's real history.

Every conversation opens with one of a few long shared system prompts (a tool catalogue,
say; conversation i gets prefix i mod `num_prefixes`), and each turn sends everything so
far: the system prompt, every earlier user message with the server's actual answer to it,
and the new user message. So turn k+1's prompt begins with turn k's prompt and answer, as
an agent's does, and a server's prefix cache can serve all of it but the new message, if
it still holds it. For chat the history goes as `messages` (ChatML-style templates, such
as the embedded SmolLM2's, render it so that turn k+1's text starts with turn k's text and
answer); for completions as plain text (`User: ...\\nAssistant:` lines) with the same
property.

What is drawn from the seed: the shared prefixes (the same in every run of a sweep, as the
synthetic shared prefix is), and per run the user messages, answer lengths and think
times, so one run is never served from another's conversations. Or the conversations come
from a JSONL trace (`file_conversations`), replayed as they are by every run. Answers are
the server's, so histories (and with them prompt lengths) depend on what it generates;
with ignore_eos (the default) every answer has its asked length, so two servers get the
same token counts.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from tokenmill.bench.workload import WORDS, AgentConfig, RequestSpec, WorkloadConfig


@dataclass(frozen=True)
class Turn:
    """One user message: its text, the answer length asked for, and the pause before it
    is sent (after the previous answer came back; 0 for a first turn)."""

    user: str
    max_tokens: int
    think_s: float


@dataclass(frozen=True)
class Conversation:
    index: int
    system: str
    turns: tuple[Turn, ...]

    def request(self, k: int, answers: list[str]) -> RequestSpec:
        """Turn `k`'s request, given the server's answers to turns 0..k-1."""
        assert len(answers) == k, "a turn is sent only after every earlier answer came back"
        # no system message where a trace gives none (the template may then add its default)
        messages: list[dict[str, Any]] = [{"role": "system", "content": self.system}] if self.system else []
        text = [self.system, "\n\n"] if self.system else []
        for turn, answer in zip(self.turns[:k], answers):
            messages += [{"role": "user", "content": turn.user}, {"role": "assistant", "content": answer}]
            text += ["User: ", turn.user, "\nAssistant:", answer, "\n"]
        turn = self.turns[k]
        messages.append({"role": "user", "content": turn.user})
        text += ["User: ", turn.user, "\nAssistant:"]
        return RequestSpec(index=self.index * len(self.turns) + k, prompt="".join(text),
                           max_tokens=turn.max_tokens, messages=messages,
                           conversation=self.index, turn=k)


def shared_prefixes(agent: AgentConfig, seed: int) -> list[str]:
    """The system prompts every run shares: `num_prefixes` texts of `prefix_len` words
    (about as many tokens), each from its own seeded stream."""
    out = []
    for p in range(agent.num_prefixes):
        rng = random.Random(f"{seed}-agent-prefix-{p}")
        out.append(" ".join(rng.choice(WORDS) for _ in range(agent.prefix_len)))
    return out


def _turn(raw: Any, where: str, cfg: WorkloadConfig, rng: random.Random, first: bool) -> Turn:
    agent = cfg.agent
    assert agent is not None
    row = {"user": raw} if isinstance(raw, str) else raw
    if not isinstance(row, dict) or not isinstance(row.get("user"), str):
        raise ValueError(f"{where}: a turn is a string or an object with a string 'user'")
    max_tokens = row.get("max_tokens", cfg.output_len.draw(rng))
    think = row.get("think_s", rng.expovariate(1.0 / agent.think_time_s) if agent.think_time_s > 0 else 0.0)
    if not isinstance(max_tokens, int) or max_tokens < 1 or not isinstance(think, (int, float)) or think < 0:
        raise ValueError(f"{where}: 'max_tokens' must be an integer >= 1 and 'think_s' a number >= 0")
    return Turn(user=row["user"], max_tokens=max_tokens, think_s=0.0 if first else float(think))


def file_conversations(cfg: WorkloadConfig) -> list[Conversation]:
    """The first `agent.conversations` conversations of the JSONL trace `cfg.prompts_file`,
    one a line: `{"system": "...", "turns": ["a user message", {"user": "...",
    "max_tokens": 32, "think_s": 1.5}, ...]}` ("system" optional). A turn without
    max_tokens or think_s draws it as a synthetic one would (from the seed, the same in
    every run)."""
    agent, path = cfg.agent, cfg.prompts_file
    assert agent is not None and path is not None
    rng = random.Random(f"{cfg.seed}:agent-file")
    convs: list[Conversation] = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if len(convs) == agent.conversations:
                break
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not JSON: {exc}") from exc
            if not isinstance(row, dict) or not isinstance(row.get("turns"), list) or not row["turns"]:
                raise ValueError(f"{where}: needs 'turns', a non-empty list")
            if not isinstance(row.get("system", ""), str):
                raise ValueError(f"{where}: 'system' must be a string")
            turns = tuple(_turn(t, where, cfg, rng, k == 0) for k, t in enumerate(row["turns"]))
            convs.append(Conversation(index=len(convs), system=row.get("system", ""), turns=turns))
    if len(convs) < agent.conversations:
        raise ValueError(f"{path}: {len(convs)} conversations, {agent.conversations} asked for")
    return convs


def build_conversations(cfg: WorkloadConfig, run_index: int = 0) -> list[Conversation]:
    """The conversations of run `run_index`: from the trace file if there is one; else
    prefixes shared by every run, user messages, answer lengths and think times drawn per run."""
    agent = cfg.agent
    assert agent is not None, "not an agent workload"
    if cfg.prompts_file is not None:
        return file_conversations(cfg)
    prefixes = shared_prefixes(agent, cfg.seed)
    rng = random.Random(f"{cfg.seed}:agent:{run_index}")
    convs = []
    for i in range(agent.conversations):
        turns = []
        for k in range(agent.turns):
            n = cfg.input_len.draw(rng)
            user = " ".join(rng.choice(WORDS) for _ in range(n))
            think = rng.expovariate(1.0 / agent.think_time_s) if k and agent.think_time_s > 0 else 0.0
            turns.append(Turn(user=user, max_tokens=cfg.output_len.draw(rng), think_s=think))
        convs.append(Conversation(index=i, system=prefixes[i % len(prefixes)], turns=tuple(turns)))
    return convs
