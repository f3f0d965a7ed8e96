"""Per-request sampling parameters and what comes back for a request."""

from __future__ import annotations

import dataclasses
from typing import Literal

from ee_jax.errors import EEJaxError


class InvalidRequestError(EEJaxError, ValueError):
    """A request that cannot be served as given; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request (vLLM's names and defaults where they exist).

    temperature 0 is greedy. top_k <= 0 and top_p == 1 switch those filters off. `seed`
    makes a request reproducible whatever else shares its batch; without one the engine
    derives a seed from the request's id.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    exit_threshold: float | None = None  # early-exit threshold for this request (else global)
    # Teacher forcing (evaluation): the sequence continues with these tokens whatever the
    # model samples; what it sampled comes back as RequestOutput.predicted_token_ids. The
    # request ends after len(forced_tokens) tokens (or max_tokens, or a forced stop token).
    forced_tokens: tuple[int, ...] = ()

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "forced_tokens", tuple(int(t) for t in self.forced_tokens))
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidRequestError(
                f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise InvalidRequestError(
                f"temperature must be >= 0 (0 means greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int):
            raise InvalidRequestError(f"top_k must be an integer (<= 0 disables), got "
                                      f"{self.top_k!r}")
        if self.seed is not None and not 0 <= self.seed < 2**31:
            raise InvalidRequestError(f"seed must be in [0, 2**31), got {self.seed!r}")
        if self.exit_threshold is not None and not (
                0.0 <= self.exit_threshold <= 1.0 or self.exit_threshold == float("inf")):
            raise InvalidRequestError(
                f"exit_threshold must be in [0, 1] (or float('inf') for never), got "
                f"{self.exit_threshold!r}")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def greedy(max_tokens: int = 16, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


FinishReason = Literal["stop", "length", "abort", "error"]


@dataclasses.dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclasses.dataclass
class RequestOutput:
    """What a request produced so far (streaming) or in the end (`finished`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None = None
    error: str | None = None
    logprobs: list[float] | None = None
    exit_layers: list[int] | None = None
    predicted_token_ids: list[int] | None = None  # teacher forcing: what the model sampled
    metrics: RequestMetrics | None = None
    new_text: str = ""  # text added by the last step (for streaming)
