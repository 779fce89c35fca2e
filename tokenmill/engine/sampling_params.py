"""How one request wants its tokens chosen and when it wants to stop.

Validated once, before anything is scheduled: a bad value raises `InvalidParameter`
naming the parameter, which the server turns into a 400.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class InvalidParameter(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


MAX_TOP_LOGPROBS = 20


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to the context window
    min_tokens: int = 0
    logprobs: int | None = None  # None: no logprobs; k: the chosen token's plus top-k
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        def check(ok: bool, param: str, message: str) -> None:
            if not ok:
                raise InvalidParameter(param, message)

        check(isinstance(self.n, int) and self.n >= 1, "n", f"n must be at least 1, got {self.n}")
        check(self.temperature >= 0.0, "temperature", f"temperature must be >= 0, got {self.temperature}")
        check(0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        check(self.top_k >= -1, "top_k", f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        check(0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}")
        check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
              f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
              f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        check(self.repetition_penalty > 0.0, "repetition_penalty",
              f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
              f"max_tokens must be at least 1, got {self.max_tokens}")
        check(self.min_tokens >= 0, "min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
              f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            check(v is None or 0 <= v <= MAX_TOP_LOGPROBS, name,
                  f"{name} must be between 0 and {MAX_TOP_LOGPROBS}, got {v}")
        check(self.seed is None or isinstance(self.seed, int), "seed", "seed must be an integer")
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
              "stop_token_ids must be non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
