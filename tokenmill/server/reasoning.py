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

from dataclasses import dataclass

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
