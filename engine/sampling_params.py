"""SamplingParams: what a request asks of the sampler, validated on construction.

Follows vLLM's names and conventions (top_k=-1 disables top-k, temperature=0 is greedy),
so user code written against vLLM's offline API runs unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass
class _Fields:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    # None: no logprobs. k >= 0: the sampled token's logprob plus the k most likely.
    logprobs: int | None = None
    skip_special_tokens: bool = True


_NAMES = tuple(f.name for f in fields(_Fields))


class SamplingParams(_Fields):
    """Validated sampling parameters; any bad value raises ValueError naming the field."""

    def __init__(self, **kwargs):
        unknown = sorted(set(kwargs) - set(_NAMES))
        if unknown:
            raise ValueError(
                f"unknown SamplingParams field(s) {unknown}; allowed: {', '.join(_NAMES)}"
            )
        super().__init__(**kwargs)
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, allowed: str):
            raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "an integer >= 1")
        for name in ("temperature", "top_p", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                bad(name, "a number")
            setattr(self, name, float(value))
        if not self.temperature >= 0.0:
            bad("temperature", ">= 0")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1 or self.top_k == 0:
            bad("top_k", "-1 (disabled) or an integer >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            bad("repetition_penalty", "> 0")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "a non-empty string or a list of non-empty strings")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "a list of non-negative integers")
        if self.seed is not None and not _is_int(self.seed):
            bad("seed", "an integer or None")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not
                                          0 <= self.logprobs <= 20):
            bad("logprobs", "None or an integer in [0, 20]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def __repr__(self) -> str:
        body = ", ".join(f"{n}={getattr(self, n)!r}" for n in _NAMES)
        return f"SamplingParams({body})"


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
