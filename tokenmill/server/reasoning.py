"""Reasoning: a thinking model's `<think>…</think>` block split from its answer, at the
server's edge (as tools.py is for tool calls). Text in, (reasoning, content) out.

Two parsers, as vLLM names them:
- `deepseek_r1`: the reply is thinking from its first token (an opening `<think>`, if
  the model writes one, is dropped) up to `</think>`; a reply that never closes is all
  reasoning (content None).
- `qwen3`: the reply thinks only if it opens with `<think>` (after whitespace) or the
  prompt opened the block (the template ended the prompt inside `<think>`); otherwise
  all of it is content (`enable_thinking: false`: the template wrote an empty, closed
  block into the prompt).

A prompt that ends inside an open block (its last `<think>` after its last `</think>`)
makes either parser start inside the thinking. The same state machine runs on the whole
reply and on a stream of deltas, so both give the same split wherever the tags fall
between deltas. The answer after the thinking is what tool-call parsing and structured
output see.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from tokenmill.engine.types import InvalidParameter, SamplingParams, ThinkingTags

OPEN = "<think>"
CLOSE = "</think>"
PARSERS = ("deepseek_r1", "qwen3")

# reasoning_effort -> thinking_token_budget (tags included). OpenAI names three levels and
# leaves their sizes to the model; these are Qwen3's documented budget examples scaled to
# small models: a short, a moderate and a long thought.
EFFORT_BUDGETS = {"low": 256, "medium": 1024, "high": 4096}


def parser_for_template(source: str | None) -> str | None:
    """The parser a chat template implies: qwen3 when it mentions `<think>` (it handles a
    reply that does not think), else none."""
    return "qwen3" if source and OPEN in source else None


def prompt_opens_thinking(prompt: str) -> bool:
    """The rendered prompt ends inside an open thinking block."""
    i = prompt.rfind(OPEN)
    return i >= 0 and prompt.rfind(CLOSE) < i


def _partial(buf: str, tag: str) -> int:
    """The length of buf's longest suffix that is a proper prefix of tag."""
    for n in range(min(len(buf), len(tag) - 1), 0, -1):
        if tag.startswith(buf[-n:]):
            return n
    return 0


@dataclass
class ReasoningParser:
    """Feed deltas, then finish(); each call returns (reasoning, content) to send now."""
    kind: str
    inside: bool = False  # the prompt opened the block

    def __post_init__(self) -> None:
        if self.kind not in PARSERS:
            raise ValueError(f"reasoning parser must be one of {', '.join(PARSERS)}, got {self.kind!r}")
        # "start": nothing decided yet; "think": inside the block; "answer": after it (or none)
        self.state = "think" if self.inside else "start"
        self.buf = ""
        self.reasoning = ""  # all sent so far, for the whole message
        self.content = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning, content = "", ""
        if self.state == "start":
            head = self.buf.lstrip()
            if len(head) < len(OPEN) and OPEN.startswith(head):
                return "", ""  # may still open
            if head.startswith(OPEN):
                self.buf, self.state = head[len(OPEN):], "think"
            else:
                self.state = "think" if self.kind == "deepseek_r1" else "answer"
        if self.state == "think":
            i = self.buf.find(CLOSE)
            if i < 0:
                keep = _partial(self.buf, CLOSE)
                reasoning, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
            else:
                reasoning, self.buf, self.state = self.buf[:i], self.buf[i + len(CLOSE):], "answer"
        if self.state == "answer":
            content, self.buf = self.buf, ""
        self.reasoning += reasoning
        self.content += content
        return reasoning, content

    def step(self, text: str, last: bool) -> tuple[str, str]:
        """feed(text), and finish() too on the reply's last delta."""
        reasoning, content = self.feed(text)
        if last:
            r, c = self.finish()
            reasoning, content = reasoning + r, content + c
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back: a partial tag at the end is text after all."""
        rest, self.buf = self.buf, ""
        if self.state == "start":
            if self.kind == "deepseek_r1":
                self.reasoning += rest
                return rest, ""
            self.content += rest
            return "", rest
        if self.state == "think":
            self.reasoning += rest
            return rest, ""
        self.content += rest
        return "", rest


def split(kind: str, text: str, inside: bool = False) -> tuple[str | None, str | None]:
    """A whole reply as (reasoning_content, content): None for a part that is empty, as
    vLLM gives it (content None when the thinking never closed)."""
    p = ReasoningParser(kind, inside)
    p.feed(text)
    p.finish()
    return p.reasoning or None, p.content or None


# names the server passes to every chat template itself
_RESERVED = frozenset({"messages", "add_generation_prompt", "tools", "bos_token", "eos_token"})


def template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """A request's chat_template_kwargs (e.g. enable_thinking: false), checked."""
    if not kwargs:
        return {}
    clash = sorted(_RESERVED & set(kwargs))
    if clash:
        raise InvalidParameter("chat_template_kwargs", f"chat_template_kwargs may not set {', '.join(clash)} "
                                                       "(the request's own fields set them)")
    return dict(kwargs)


class ChatReasoning:
    """One server's reasoning parser and its tags' token ids (what the engine counts and
    forces: `ThinkingTags`)."""

    def __init__(self, kind: str, tokenizer) -> None:
        if kind not in PARSERS:
            raise ValueError(f"reasoning parser must be one of {', '.join(PARSERS)}, got {kind!r}")
        self.kind = kind
        self.tags = ThinkingTags(tuple(tokenizer.encode(OPEN, add_special_tokens=False)),
                                 tuple(tokenizer.encode(CLOSE, add_special_tokens=False)),
                                 always=kind == "deepseek_r1")

    @classmethod
    def choose(cls, option: str | None, tokenizer) -> ChatReasoning | None:
        """`option`: --reasoning-parser (None: from the chat template; "none": off)."""
        if option is None:
            template = tokenizer.chat_template
            option = parser_for_template(template.source if template is not None else None)
        return None if option in (None, "none") else cls(option, tokenizer)

    def apply(self, prompt: str, params: SamplingParams, budget: int | None, effort: str | None) -> ThinkingTags:
        """Give the request's params the tags (started inside when the prompt opened the
        block) and its budget: thinking_token_budget, else reasoning_effort's."""
        tags = dataclasses.replace(self.tags, inside=prompt_opens_thinking(prompt))
        params.thinking = tags
        params.thinking_token_budget = budget if budget is not None else EFFORT_BUDGETS.get(effort)
        return tags

    def parser(self, tags: ThinkingTags) -> ReasoningParser:
        return ReasoningParser(self.kind, tags.inside)
