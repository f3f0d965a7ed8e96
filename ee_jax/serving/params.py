"""Per-request sampling parameters and what comes back for a request."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Literal

from ee_jax.errors import EEJaxError


class InvalidRequestError(EEJaxError, ValueError):
    """A request that cannot be served as given; the message says what to change.

    `param` names the offending field where there is one (the HTTP server reports it as
    OpenAI's `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _finite(name: str, x) -> float:
    """x as a float, or InvalidRequestError naming `name` (a string, bool, inf or nan)."""
    if not isinstance(x, numbers.Real) or isinstance(x, bool) or not math.isfinite(x):
        raise InvalidRequestError(f"{name} must be a finite number, got {x!r}", name)
    return float(x)


def _int_tuple(name: str, xs) -> tuple[int, ...]:
    if isinstance(xs, str | bytes) or not all(_is_int(t) for t in xs):
        raise InvalidRequestError(f"{name} must be a list of integer token ids, got {xs!r}", name)
    return tuple(int(t) for t in xs)


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
        if self.stop is None or not all(isinstance(s, str) for s in self.stop):
            raise InvalidRequestError(f"stop must be a string or a list of strings, got "
                                      f"{self.stop!r}", "stop")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids",
                           _int_tuple("stop_token_ids", self.stop_token_ids))
        object.__setattr__(self, "forced_tokens", _int_tuple("forced_tokens", self.forced_tokens))
        if not _is_int(self.max_tokens) or self.max_tokens <= 0:
            raise InvalidRequestError(
                f"max_tokens must be a positive integer, got {self.max_tokens!r}", "max_tokens")
        # Non-finite knobs (inf, nan) would reach the sampler as garbage: refuse them here.
        if not _finite("temperature", self.temperature) >= 0:
            raise InvalidRequestError(
                f"temperature must be >= 0 (0 means greedy), got {self.temperature!r}",
                "temperature")
        if not 0 < _finite("top_p", self.top_p) <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not _is_int(self.top_k) or not -2**31 <= self.top_k < 2**31:  # an int32 on device
            raise InvalidRequestError(f"top_k must be an integer below 2**31 (<= 0 disables), "
                                      f"got {self.top_k!r}", "top_k")
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < 2**31):
            raise InvalidRequestError(f"seed must be an integer in [0, 2**31), got "
                                      f"{self.seed!r}", "seed")
        t = self.exit_threshold
        if t is not None and (not isinstance(t, numbers.Real) or isinstance(t, bool) or not (
                0.0 <= t <= 1.0 or t == float("inf"))):
            raise InvalidRequestError(
                f"exit_threshold must be in [0, 1] (or float('inf') for never), got {t!r}",
                "exit_threshold")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty", "stop")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def greedy(max_tokens: int = 16, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


FinishReason = Literal["stop", "length", "abort", "error"]


def acceptance_rate(accepted: int, drafted: int) -> float | None:
    """Verified exits: the share of drafts the full model confirmed (None: no draft yet)."""
    return accepted / drafted if drafted else None


@dataclasses.dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    # seconds of engine steps that compiled a program while this request waited for its
    # first token (a warm server would not have made it wait for them)
    compile_wait: float = 0.0
    # verified exits: drafts the exit heads made for this request, and those the full model
    # confirmed (each confirmed draft is a token emitted without its own full-depth step)
    num_drafted: int = 0
    num_accepted: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        return acceptance_rate(self.num_accepted, self.num_drafted)

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def warm_time_to_first_token(self) -> float | None:
        """Time to first token less the steps that compiled meanwhile (`compile_wait`)."""
        ttft = self.time_to_first_token
        return None if ttft is None else ttft - self.compile_wait

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
