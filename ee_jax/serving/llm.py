"""`LLM`: the offline batch API (vLLM's shape) on top of the step-wise engine."""

from __future__ import annotations

import dataclasses
import numbers
import sys
import time
from collections.abc import Sequence as Seq

import numpy as np
from tqdm.auto import tqdm

from ee_jax.models.exits.config import SERVING_POLICY, ExitConfig
from ee_jax.models.loading import LoadedModel, load_model, quantize_model
from ee_jax.serving import sharding
from ee_jax.serving.controller import ControllerConfig
from ee_jax.serving.engine import EngineConfig, LLMEngine
from ee_jax.serving.params import (
    InvalidRequestError,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
)

Prompt = str | list[int]


class LLM:
    """Load a model once, then `generate` batches of prompts with continuous batching.

        llm = LLM("smollm2-135m-instruct")
        outs = llm.generate(["def fib(n):"], SamplingParams(temperature=0, max_tokens=64))
    """

    def __init__(self, model: str | LoadedModel = "smollm2-135m-instruct", *,
                 dtype: str = "float32", quantize: str | None = None, progress: bool = True,
                 exit_config: ExitConfig | None = None, exit_heads=None,
                 early_exit: bool = True, tokenizer: str | None = None, **engine_kwargs):
        """Without `exit_config`, a model that comes with exit heads (SmolLM2's shipped ones,
        an EE-LLM checkpoint's own, a converted folder's `exit_heads/`) serves with them;
        `early_exit=False` serves at full depth instead. quantize="int8" serves int8 layer
        weights (per-output-channel scales; exit heads stay in the model dtype). tokenizer: a
        tokenizer.json or its folder, for a model that holds none (a Megatron checkpoint)."""
        t0 = time.perf_counter()
        spec = engine_kwargs.get("mesh")
        mesh = sharding.MeshSpec.parse(spec).make_mesh() if spec else None  # built once
        self.model = quantize_model(model, quantize) if isinstance(model, LoadedModel) else \
            load_model(model, dtype=dtype, quantize=quantize, progress=progress,
                       placement=sharding.placement(spec, mesh) if spec else None,
                       tokenizer=tokenizer)
        if not early_exit:
            exit_config, exit_heads = None, None
        elif exit_config is None and exit_heads is None:
            shipped = self.model.shipped_exit_heads()
            if shipped is not None:  # served under the one serving policy (as the CLI)
                exit_config, exit_heads = shipped
                exit_config = dataclasses.replace(exit_config, policy=SERVING_POLICY)
                control = engine_kwargs.get("exit_control", ControllerConfig())
                if control.prior is None:  # the controller starts from the calibration
                    engine_kwargs["exit_control"] = dataclasses.replace(
                        control, prior=self.model.shipped_exit_prior(exit_config))
        self.load_time = time.perf_counter() - t0
        config = EngineConfig.make(**engine_kwargs)
        self.engine = LLMEngine(self.model.config, self.model.params, self.model.tokenizer,
                                config, exit_config, exit_heads, mesh=mesh)
        if self.engine.runner.layer_layout == "per_layer":  # hold what is served, so the
            # stacked arrays the runner unstacked are freed (a model loaded here: else the
            # weights twice in device memory; a caller's LoadedModel keeps its own)
            self.model = dataclasses.replace(self.model, params=self.engine.runner.params)
        self._counter = 0

    @property
    def tokenizer(self):
        return self.model.tokenizer

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None, *,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Outputs in the order of `prompts`. A bad prompt yields an output with
        `finish_reason == "error"` and `error` set; the others are served normally."""
        if isinstance(prompts, np.ndarray):
            prompts = prompts.tolist()
        if isinstance(prompts, str) or (
                isinstance(prompts, Seq) and prompts and _is_token_id(prompts[0])):
            prompts = [prompts]
        if not isinstance(prompts, Seq):
            raise InvalidRequestError(f"prompts must be a string, a list of token ids or a list "
                                      f"of those, got {type(prompts).__name__}", "prompts")
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise InvalidRequestError(f"got {len(prompts)} prompts but {len(sampling_params)} "
                                      f"SamplingParams: give one, or one per prompt")
        results: dict[str, RequestOutput] = {}
        order = []
        for prompt, sp in zip(prompts, sampling_params, strict=True):
            rid = f"req-{self._counter}"
            self._counter += 1
            order.append(rid)
            try:  # one bad request gets an error output; the others are served
                self.engine.add_request(rid, _checked_prompt(prompt), sp)
            except InvalidRequestError as e:
                results[rid] = _error_output(rid, prompt, str(e))
        total = sum(int(sp.max_tokens) for rid, sp in zip(order, sampling_params, strict=True)
                    if rid not in results)
        bar = tqdm(total=total, desc="generate", unit="tok", file=sys.stderr,
                   disable=not use_tqdm, leave=False)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                bar.update(1)
                if out.finished:
                    results[out.request_id] = out
        bar.close()
        return [results[rid] for rid in order]

    def chat(self, conversations, sampling_params=None, **kw) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True)
                   for c in conversations]
        return self.generate(prompts, sampling_params, **kw)


def _is_token_id(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _checked_prompt(prompt) -> Prompt:
    """A str or a list of ints, else InvalidRequestError (the engine would raise TypeError)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, np.ndarray) and prompt.ndim == 1:
        prompt = prompt.tolist()
    if isinstance(prompt, Seq) and all(_is_token_id(t) for t in prompt):
        return [int(t) for t in prompt]
    raise InvalidRequestError(f"a prompt must be a string or a list of integer token ids, got "
                              f"{prompt!r:.80}", "prompt")


def _error_output(rid: str, prompt: Prompt, message: str) -> RequestOutput:
    now = time.perf_counter()
    return RequestOutput(
        request_id=rid, prompt=prompt if isinstance(prompt, str) else None,
        prompt_token_ids=(list(prompt) if isinstance(prompt, Seq) and not isinstance(prompt, str)
                          else []), text="",
        token_ids=[], finished=True, finish_reason="error", error=message,
        metrics=RequestMetrics(arrival_time=now, finish_time=now))

