"""The OpenAI request bodies ee-jax accepts, checked, and turned into engine requests.

Bodies are validated with pydantic in strict mode (a string is not a number, a bool is not an
int); fields OpenAI defines that ee-jax does not implement are refused by name when set to
anything but their neutral value, and unknown fields are ignored (clients send extras).
Every problem becomes an `ApiError` naming the field: the app answers it as OpenAI does,
`{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ee_jax.serving.params import InvalidRequestError, SamplingParams


class ApiError(Exception):
    """An HTTP error with an OpenAI-style body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after  # seconds, sent as the Retry-After header
        self.type = type or ("authentication_error" if status == 401 else
                             "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: Any = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    # ee-jax's own fields (vLLM puts top_k and ignore_eos at the top level too).
    top_k: int | None = None
    ignore_eos: bool = False
    exit_threshold: float | None = None
    early_exit: bool | None = None
    # verified exits: true asks that the output be full depth's (a server started with
    # --verify-exits, or any server's early_exit false); false: no drafts (full depth)
    verify_exits: bool | None = None


class CompletionBody(_Body):
    prompt: Any
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatBody(_Body):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None


def parse(kind: type[_Body], obj: Any) -> Any:
    """The body as `kind`, or ApiError 400 naming the first bad field."""
    if not isinstance(obj, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return kind.model_validate(obj)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(p) for p in err["loc"]]
        field = loc[0] if loc else None
        where = ".".join(loc) if loc else "body"
        msg = err["msg"] if err["type"] != "missing" else "this field is required"
        raise ApiError(400, f"invalid '{where}': {msg}", field) from None


@dataclasses.dataclass(frozen=True)
class Limits:
    max_model_len: int
    max_prompt_tokens: int
    vocab_size: int
    has_exits: bool
    verifies: bool = False  # exits are verified drafts (ExitConfig.verify): lossless


def _check_unsupported(body: _Body) -> None:
    for name, neutral in (("presence_penalty", 0), ("frequency_penalty", 0)):
        value = getattr(body, name)
        if value is not None and value != neutral:
            raise ApiError(400, f"{name} is not supported by ee-jax; leave it out (or 0)", name)
    if body.logit_bias:
        raise ApiError(400, "logit_bias is not supported by ee-jax; leave it out", "logit_bias")
    if isinstance(body, CompletionBody):
        if body.echo:
            raise ApiError(400, "echo is not supported by ee-jax; leave it out", "echo")
        if body.suffix:
            raise ApiError(400, "suffix is not supported by ee-jax; leave it out", "suffix")
        if body.best_of not in (None, 1, body.n):
            raise ApiError(400, "best_of is not supported by ee-jax; use n", "best_of")
        if body.logprobs not in (None, 0):
            raise ApiError(400, "logprobs must be 0 or absent: ee-jax returns each sampled "
                           "token's log-probability, not the top alternatives", "logprobs")
    if isinstance(body, ChatBody):
        if body.top_logprobs not in (None, 0):
            raise ApiError(400, "top_logprobs must be 0 or absent: ee-jax returns each sampled "
                           "token's log-probability, not the top alternatives", "top_logprobs")
        if body.tools:
            raise ApiError(400, "tools are not supported by ee-jax; leave them out", "tools")


def _stop_strings(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if (not isinstance(stop, list) or len(stop) > 16
            or not all(isinstance(s, str) and s for s in stop)):
        raise ApiError(400, "stop must be a non-empty string or a list of at most 16 of them",
                       "stop")
    return tuple(stop)


def completion_prompts(body: CompletionBody) -> list[str | list[int]]:
    """The prompts of a completions body: a string, token ids, or a list of either."""
    p = body.prompt
    if isinstance(p, str):
        return [p]
    if isinstance(p, list) and p and all(_is_int(t) for t in p):
        return [p]
    if isinstance(p, list) and p and len(p) <= 64 and all(
            isinstance(x, str) or (isinstance(x, list) and x and all(_is_int(t) for t in x))
            for x in p):
        return list(p)
    raise ApiError(400, "prompt must be a string, a list of token ids, or a non-empty list "
                   "of at most 64 of those", "prompt")


def chat_messages(body: ChatBody) -> list[dict[str, str]]:
    """Messages with string content (text parts joined), roles checked."""
    out = []
    for i, m in enumerate(body.messages):
        role, content = m.get("role"), m.get("content")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise ApiError(400, f"messages[{i}].role must be system, developer, user, "
                           f"assistant or tool, got {role!r}", "messages")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise ApiError(400, f"messages[{i}].content: only text parts "
                                   f"({{\"type\": \"text\", \"text\": ...}}) are supported",
                                   "messages")
                parts.append(part["text"])
            content = "".join(parts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of text "
                           f"parts", "messages")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def check_prompt_ids(ids: list[int], limits: Limits, field: str) -> None:
    if not ids:
        raise ApiError(400, f"the {field} is empty: give at least one token", field)
    bad = [t for t in ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise ApiError(400, f"{field} has token ids outside the vocabulary [0, "
                       f"{limits.vocab_size}): {bad[:8]}", field)
    if len(ids) > limits.max_prompt_tokens:
        raise ApiError(400, f"the {field} has {len(ids)} tokens; this server takes at most "
                       f"{limits.max_prompt_tokens} (max_model_len {limits.max_model_len}): "
                       f"shorten it", field, code="context_length_exceeded")


def sampling_params(body: _Body, prompt_len: int, index: int, limits: Limits,
                    chat: bool) -> SamplingParams:
    """The engine's SamplingParams for choice `index` of a request (seeds differ by index)."""
    _check_unsupported(body)
    max_tokens = body.max_tokens
    if chat and body.max_completion_tokens is not None:
        max_tokens = body.max_completion_tokens
    if max_tokens is None:  # OpenAI: 16 for completions, as many as fit for chat
        max_tokens = 16 if not chat else max(1, limits.max_model_len - prompt_len)
    if max_tokens <= 0:
        raise ApiError(400, f"max_tokens must be a positive integer, got {max_tokens}",
                       "max_completion_tokens" if chat and body.max_completion_tokens
                       is not None else "max_tokens")
    threshold = body.exit_threshold
    if body.verify_exits and limits.has_exits and not limits.verifies:
        raise ApiError(400, "this server's early exits are not verified (their tokens may "
                       "differ from full depth's): start it with --verify-exits, or send "
                       "early_exit: false for full depth", "verify_exits")
    if body.early_exit is False or body.verify_exits is False:
        threshold = float("inf")
    elif threshold is not None and not limits.has_exits:
        raise ApiError(400, "this server runs at full depth (no exit heads): leave "
                       "exit_threshold out", "exit_threshold")
    seed = None if body.seed is None else (body.seed + index) % 2**31
    if body.seed is not None and body.seed < 0:
        raise ApiError(400, f"seed must be >= 0, got {body.seed}", "seed")
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if body.temperature is None
            else body.temperature, top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0, seed=seed, stop=_stop_strings(body.stop),
            ignore_eos=body.ignore_eos,
            logprobs=bool(body.logprobs is not None if isinstance(body, CompletionBody)
                          else body.logprobs),
            exit_threshold=threshold)
    except InvalidRequestError as e:
        raise ApiError(400, str(e), e.param) from None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


FinishReason = Literal["stop", "length", "abort", "error"]
