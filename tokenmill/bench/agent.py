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
times, so one run is never served from another's conversations. Answers are the server's,
so histories (and with them prompt lengths) depend on what it generates; with ignore_eos
(the default) every answer has its asked length, so two servers get the same token counts.
"""

from __future__ import annotations

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
        messages: list[dict[str, Any]] = [{"role": "system", "content": self.system}]
        text = [self.system, "\n\n"]
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


def build_conversations(cfg: WorkloadConfig, run_index: int = 0) -> list[Conversation]:
    """The conversations of run `run_index`: prefixes shared by every run, user messages,
    answer lengths and think times drawn per run."""
    agent = cfg.agent
    assert agent is not None, "not an agent workload"
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
