"""The step-wise engine: requests in, one scheduled step at a time, outputs out.

A thin stateful shell around pure parts: the scheduler decides, the block manager counts
pages, the model runner executes one compiled step. Each step moves one packed buffer to
the device and one small result array back.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import time
import zlib
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh
from tqdm.auto import tqdm

from ee_jax.errors import TokenizationError
from ee_jax.models import llama
from ee_jax.models.config import ModelConfig
from ee_jax.models.exits.config import ExitConfig
from ee_jax.models.tokenizer import IncrementalDecoder
from ee_jax.serving import distributed, sharding
from ee_jax.serving.block_manager import BlockManager
from ee_jax.serving.compilation import (
    ProgramCache,
    check_memory_maps,
    compiles_on_this_thread,
    pipelined,
)
from ee_jax.serving.controller import ExitController, exit_predictor
from ee_jax.serving.input_batch import PENDING, InputBatch
from ee_jax.serving.kv_cache import allocate_cache
from ee_jax.serving.model_runner import (
    ModelRunner,
    StepBatch,
    StepShape,
    unpack_results,
)
from ee_jax.serving.params import (
    InvalidRequestError,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
)
from ee_jax.serving.plan import EngineConfig, engine_plan
from ee_jax.serving.scheduler import Schedule, Scheduler, Sequence
from ee_jax.serving.stats import EngineStats


@dataclasses.dataclass
class _Launched:
    """A dispatched step: what was scheduled, its device result, and for each row the index
    in the request's output of the token it samples (-1: none)."""

    schedule: Schedule
    result: Any
    t0: float
    compiles: bool
    out_idx: list[int]
    exits: bool = True  # a decode step: whether it ran the exit program
    riding: list[int] | None = None  # verified exits: each row's drafts before the step
    epochs: list[int] | None = None  # each row's Sequence.epoch at launch (verified exits)
    # seconds the host spent compiling the next step's program while this one was in flight
    # (async scheduling): the device was idle then, so it is not this step's time
    compile_gap: float = 0.0


class LLMEngine:
    def __init__(self, cfg: ModelConfig, params: llama.Params | dict, tokenizer=None,
                 config: EngineConfig | None = None,
                 exit_config: ExitConfig | None = None, exit_heads=None, *,
                 mesh: Mesh | None = None):
        """mesh: the devices `config.mesh` describes, when the caller built them already
        (`LLM` builds one mesh for the loader's placement and the engine)."""
        config = config or EngineConfig()
        self.model_config = cfg
        self.config = config
        self.tokenizer = tokenizer
        if mesh is not None and not config.mesh:
            raise sharding.MeshError("a mesh was given but EngineConfig.mesh is None: set "
                                     "mesh='tp=N,dp=M' to the mesh's axes")
        # What the steps are built for, read once here: the plan resolves the backend on it
        # and both go into the step's static config (`StepConfig`), never read while tracing.
        platform = (mesh.devices.flat[0] if mesh is not None else jax.local_devices()[0]).platform
        self.plan = plan = engine_plan(cfg, config, platform)
        self.exit_config = exit_config
        cache_sharding = None
        if plan.mesh is not None:
            mesh = plan.mesh.make_mesh() if mesh is None else sharding.check_mesh(plan.mesh, mesh)
            cache_sharding = sharding.cache_sharding(cfg, mesh)
        self.mesh = mesh
        sched_cfg = plan.scheduler
        self.blocks = BlockManager(plan.num_pages, plan.page_size, sched_cfg.pages_per_seq)
        self.scheduler = Scheduler(sched_cfg, self.blocks)
        # the running requests' step inputs, kept across steps (architecture.md section 3)
        self.input_batch = InputBatch(self.blocks, sched_cfg.max_num_seqs,
                                      exit_config.threshold if exit_config else np.inf)
        self.runner = ModelRunner(cfg, params,
                                  allocate_cache(cfg, plan.num_pages, plan.page_size,
                                                 plan.kv_dtype, sharding=cache_sharding,
                                                 head_major=plan.head_major,
                                                 platform=plan.platform),
                                  exit_config, exit_heads, attention=plan.attention,
                                  max_batch=plan.max_batch, mesh=mesh, platform=plan.platform,
                                  layout_shape=plan.layout_shape(exit_config is not None),
                                  layer_layout=plan.layer_layout)
        # Verified exits (ExitConfig.verify): how many tokens a decode step emits is known
        # only once it is read (drafts, or a verify that keeps a prefix); with overlapped
        # steps the next one is launched as if one token came, and the device takes what a
        # verify dropped off its positions (`step.Pending.rollback`).
        self.verify = exit_config is not None and exit_config.enabled and exit_config.verify
        self.controller = None
        if exit_config is not None and exit_config.enabled:
            # the runner's exit config: its row buckets are what the exit program runs
            self.controller = ExitController(config.exit_control, exit_predictor(
                cfg, self.runner.exit_config, config.exit_control, self.runner.exit_heads,
                platform),
                verified=self.verify)
        self.stats = EngineStats()
        self._inflight: _Launched | None = None  # the launched step not yet read
        self._waited = 0.0  # seconds this step() call waited for the device
        self._last_ready = 0.0
        self._requests: dict[str, Sequence] = {}
        self._seq_ids = itertools.count(1)
        self._eos = set(cfg.eos_token_ids)
        if tokenizer is not None:
            self._eos |= set(getattr(tokenizer, "stop_token_ids", ()) or ())

    # -- requests ----------------------------------------------------------------------

    def validate(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """The prompt's token ids, or InvalidRequestError saying what is wrong."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"expected SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this engine has no tokenizer: pass token ids")
            try:  # e.g. a lone surrogate ("\udcff"): TokenizationError says where
                ids = list(self.tokenizer.encode(prompt))
            except TokenizationError as e:
                raise InvalidRequestError(f"the prompt cannot be tokenized: {e}", "prompt") from e
        else:
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"prompt has token ids outside the vocabulary [0, "
                    f"{self.model_config.vocab_size}): {bad[:8]}")
        if not ids:
            raise InvalidRequestError("the prompt is empty: give at least one token")
        bad = [t for t in params.forced_tokens if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"forced_tokens has ids outside the vocabulary [0, "
                f"{self.model_config.vocab_size}): {bad[:8]}")
        max_len = self.config.scheduler.max_model_len
        if len(ids) >= max_len:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens but max_model_len is {max_len} (room is "
                f"needed for at least one new token): shorten the prompt or raise max_model_len")
        return ids

    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None) -> None:
        params = params or SamplingParams()
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        ids = self.validate(prompt, params)
        seed = params.seed if params.seed is not None else zlib.crc32(request_id.encode()) >> 1
        seq = Sequence(request_id=request_id, seq_id=next(self._seq_ids),
                       prompt=prompt if isinstance(prompt, str) else None,
                       prompt_token_ids=ids, params=params, seed=seed,
                       metrics=RequestMetrics(arrival_time=time.perf_counter()))
        if self.tokenizer is not None:
            seq.detokenizer = IncrementalDecoder(self.tokenizer)
        self._requests[request_id] = seq
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return None
        seq.finish_reason = "abort"
        seq.metrics.finish_time = time.perf_counter()
        self.scheduler.release(seq)
        self.input_batch.remove(seq.seq_id)
        return self._output(seq, "")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    # -- one step ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and launch one step; returns an output for every request that progressed.

        With `async_scheduling` (the default) the host never waits for the device before
        launching: step n+1 is scheduled and dispatched while step n runs (decode rows take
        their input token from step n's device result), then step n's tokens are read and
        processed, so outputs arrive one `step()` call later. Tokens are identical to the
        blocking order (`async_scheduling=False`): sampling depends only on each request's
        seed and token count. A request that finishes at step n may ride along in step n+1
        as a row whose result is dropped.
        """
        t0 = time.perf_counter()
        outputs: list[RequestOutput] = []
        schedule = self.scheduler.schedule() if self.scheduler.has_schedulable() else None
        if schedule is not None and self._inflight is not None \
                and self._needs_host_tokens(schedule):
            outputs += self._finish(self._inflight)  # e.g. a preempted request's recompute
            self._inflight = None
        launched = self._launch(schedule) if schedule is not None else None
        if self._inflight is not None:
            outputs += self._finish(self._inflight)
        self._inflight = launched
        if launched is not None and not self.config.async_scheduling:
            outputs += self._finish(launched)
            self._inflight = None
        self.stats.host_time += time.perf_counter() - t0 - self._waited
        self._waited = 0.0
        return outputs

    def _needs_host_tokens(self, schedule: Schedule) -> bool:
        """Whether a row needs a token the in-flight step is still sampling, other than a
        decode row's input (which the device passes on by itself)."""
        for row in schedule.rows:
            lo = row.start + (1 if row.num_tokens == 1 else 0)  # a one-token row reads it
            #                                                     from the device itself
            if any(t == PENDING for t in row.seq.tokens(lo, row.start + row.num_tokens)):
                return True
        return False

    def _launch(self, schedule: Schedule) -> _Launched:
        """Build the step's inputs, dispatch it, and advance every row's host state as if
        the step had run (its sampled token PENDING until `_finish` reads it)."""
        self.stats.num_preemptions += len(schedule.preempted)
        batch = self._build_batch(schedule)
        if schedule.kind == "decode" and self.controller is not None \
                and not self.controller.use_exits(batch.shape.batch) \
                and not any(row.seq.num_draft or row.seq.drafting  # runs to verify
                            for row in schedule.rows):
            batch.shape = dataclasses.replace(batch.shape, exits=False)
        if self.verify and schedule.kind == "decode" and batch.shape.exits:
            self._verify_limits(schedule, batch)
        t0 = time.perf_counter()
        for row in schedule.rows:
            if row.seq.metrics.first_scheduled_time is None:
                row.seq.metrics.first_scheduled_time = t0
        before = compiles_on_this_thread()
        result = self.runner.step(batch)
        # Any program compiled (or loaded from the persistent cache) inside the call: a new
        # shape, but also a known shape whose arguments' placement changed (jit compiles
        # again without tracing again), which counting traced shapes missed.
        compiles = compiles_on_this_thread() > before
        if compiles:  # tracing and compiling are not host time of serving
            took = time.perf_counter() - t0
            self._waited += took
            if self._inflight is not None:  # nor the time of the step in flight: the
                self._inflight.compile_gap += took  # compile's own, counted here
                self.stats.compile_time += took
            for seq in self._requests.values():  # it delayed every first token not out yet
                if seq.metrics.first_token_time is None:
                    seq.metrics.compile_wait += took
        out_idx = []
        for r, row in enumerate(schedule.rows):
            seq = row.seq
            seq.num_computed = row.start + row.num_tokens
            if not row.samples:
                out_idx.append(-1)
                continue
            n = len(seq.output_token_ids)
            out_idx.append(n)
            forced = seq.params.forced_tokens
            seq.output_token_ids.append(forced[n] if forced else PENDING)
            seq.inflight_row = r
            if n + 1 >= seq.params.max_tokens or 0 < len(forced) <= n + 1 \
                    or seq.num_tokens >= self.config.scheduler.max_model_len:
                seq.awaiting_finish = True
        riding = epochs = None
        if self.verify:
            riding = [row.seq.num_draft for row in schedule.rows]
            epochs = [row.seq.epoch for row in schedule.rows]
            if schedule.kind == "decode" and batch.shape.exits:
                for row in schedule.rows:
                    row.seq.drafting += 1
        return _Launched(schedule, result, t0, compiles, out_idx, batch.shape.exits, riding,
                         epochs)

    def _finish(self, launched: _Launched) -> list[RequestOutput]:
        """Read a launched step's results (waits for the device) and process them."""
        t_wait = time.perf_counter()
        tokens, logprobs, extra = unpack_results(np.asarray(launched.result))
        now = time.perf_counter()
        self._waited += now - t_wait
        # Device time of this step as the host sees it: from its launch, or from the previous
        # step's results if those arrived later (steps queue on the device).
        dt = max(0.0, now - max(launched.t0, self._last_ready) - launched.compile_gap)
        self._last_ready = now
        self._account(launched.schedule, dt, launched.compiles, extra)
        if launched.schedule.kind == "decode" and self.controller is not None:
            n = len(launched.schedule.rows)
            self.controller.observe(
                launched.schedule.shape.batch, launched.exits,
                [int(e) for e in extra[:n, 0]], launched.riding,
                int(extra[:n, 3].sum()) if self._verifying(extra) else n)
        return self._process(launched, tokens, logprobs, extra)

    def _verifying(self, extra: np.ndarray) -> bool:
        """Whether a step's result columns are a verified-exits step's (emitted counts and
        tokens after the exit layer, checks and work: `model_runner._verify`)."""
        return self.verify and extra.shape[1] > 3

    def _verify_limits(self, schedule: Schedule, batch: StepBatch) -> None:
        """Rows that must verify this step, not draft (threshold NEVER: the row runs every
        layer): a token that would be the request's last (max_tokens, max_model_len; the
        in-flight step's token counted, so at most a step early), so no draft sits beyond a
        limit; a draft that is a stop token (the request may end there); teacher-forced
        requests (every token is the full model's). A full run the step itself verifies."""
        for r, row in enumerate(schedule.rows):
            seq, p = row.seq, row.seq.params
            n = len(seq.output_token_ids)
            last = seq.output_token_ids[-1] if seq.num_draft and not seq.drafting else None
            if (n + 1 >= p.max_tokens
                    or seq.num_tokens + 1 >= self.config.scheduler.max_model_len or p.forced_tokens
                    or (last is not None and ((last in self._eos and not p.ignore_eos)
                                              or last in p.stop_token_ids))):
                batch.threshold[r] = np.inf
            if (seq.num_draft or seq.drafting) and batch.pend_row[r] < 0:  # its run must be
                #                                                    the latest decode step's
                raise RuntimeError(f"request {seq.request_id!r} has {seq.num_draft} drafts "
                                   f"but its run is not the latest decode step's")

    def _build_batch(self, schedule: Schedule) -> StepBatch:
        """The step's inputs from the persistent batch (`input_batch.InputBatch`): a decode
        step's are gathers from the requests' slots; a prefill step writes its query blocks
        row by row (architecture.md section 5). Decode rows whose input token the step in
        flight is sampling read it on the device."""
        return self.input_batch.prepare(schedule, latest_unread=self._inflight is not None)

    def _account(self, schedule: Schedule, dt: float, compiled: bool, extra: np.ndarray) -> None:
        """Steps that compiled a new program count as compile time, not serving time.

        extra: the step's result columns [B, 3] (model_runner.ModelRunner): exit layer per
        row, vocabulary checks, row-layers computed."""
        s = self.stats
        row_layers = [int(e) for e in extra[:len(schedule.rows), 0]]
        exit_layer = max(row_layers)  # the layers the step ran (every row's under all/quorum)
        s.num_steps += 1
        if compiled:
            s.compile_time += dt
            s.num_compiles += 1
            s.num_decode_compiles += schedule.kind == "decode"
        if schedule.kind == "prefill":
            s.num_prefill_steps += 1
            s.prefill_time += 0.0 if compiled else dt
            s.num_prompt_tokens += sum(r.num_tokens for r in schedule.rows
                                       if r.start < len(r.seq.prompt_token_ids))
            s.num_mixed_steps += any(r.start >= len(r.seq.prompt_token_ids)
                                     for r in schedule.rows)
        else:
            s.num_decode_steps += 1
            s.decode_time += 0.0 if compiled else dt
            verifying = self._verifying(extra)
            emitted = (int(extra[:len(schedule.rows), 3].sum()) if verifying
                       else len(schedule.rows))
            s.num_decode_tokens += 0 if compiled else emitted
            s.num_verify_steps += verifying and bool((extra[:len(schedule.rows), 3] > 0).any())
            s.decode_layers_run += exit_layer
            s.vocab_checks += int(extra[0, 1])
            s.step_exit_counts[exit_layer] = s.step_exit_counts.get(exit_layer, 0) + 1
            s.num_decode_rows += len(row_layers)
            s.decode_row_layers += sum(row_layers)
            s.row_layers_computed += int(extra[0, 2])
            s.row_layers_full_depth += schedule.shape.batch * self.model_config.n_layers
            for e in row_layers:
                s.row_exit_counts[e] = s.row_exit_counts.get(e, 0) + 1
        s.max_pages_used = max(s.max_pages_used, self.blocks.num_used_pages)

    def _process(self, launched: _Launched, tokens, logprobs, extra) -> list[RequestOutput]:
        now = time.perf_counter()
        outputs = []
        verifying = self._verifying(extra)
        for r, row in enumerate(launched.schedule.rows):
            seq, idx = row.seq, launched.out_idx[r]
            if idx < 0 or seq.finished:  # no token this step, or ended (stop, abort) before
                continue
            if launched.epochs is not None and launched.epochs[r] != seq.epoch:
                continue  # preempted while this step was in flight: recomputed instead
            if verifying and not seq.params.forced_tokens:
                out = self._process_verified(seq, int(tokens[r]), extra[r], now)
                if out is not None:
                    outputs.append(out)
                continue
            if verifying:  # teacher forced: it verified (never drafts)
                seq.drafting -= 1
            token = int(tokens[r])
            if seq.params.forced_tokens:  # teacher forcing: keep what the model said
                seq.predicted_token_ids.append(token)
                token = seq.output_token_ids[idx]
            else:
                seq.output_token_ids[idx] = token
            seq.logprobs.append(float(logprobs[r]))
            layer = int(extra[r, 0])
            seq.exit_layers.append(layer)
            self.stats.token_exit_counts[layer] = self.stats.token_exit_counts.get(layer, 0) + 1
            self.stats.num_generated_tokens += 1
            if seq.metrics.first_token_time is None:
                seq.metrics.first_token_time = now
            new_text = self._check_stop(seq, token, idx + 1)
            if seq.finished:
                del seq.output_token_ids[idx + 1:]  # tokens a later step sampled in flight
                seq.metrics.finish_time = now
                self.scheduler.release(seq)
                self.input_batch.remove(seq.seq_id)
                self._requests.pop(seq.request_id, None)
            outputs.append(self._output(seq, new_text))
        return outputs

    def _process_verified(self, seq: Sequence, token: int, extra: np.ndarray,
                          now: float) -> RequestOutput | None:
        """A row of a verified-exits step: a draft (nothing emitted; `token` joins the
        row's unconfirmed tail and is its next input) or a verify: the confirmed tokens
        (kept drafts, then the full model's) replace the run and this step's slot, the
        row's length rolls back past what was dropped (a step launched meanwhile had it
        taken off on the device), and only they reach the text, the stop checks and the
        client. extra: the row's result columns after the logprob."""
        P = self.exit_config.max_draft
        count = int(extra[3])
        seq.drafting -= 1
        # the output: confirmed tokens, drafts, this step's slot, a later step's (in flight)
        idx = len(seq.exit_layers) + seq.num_draft
        later = seq.output_token_ids[idx + 1:]
        if not later:  # no step in flight for it: schedulable again unless it finishes
            seq.awaiting_finish = False
        if count == 0:
            seq.output_token_ids[idx] = token
            seq.num_draft += 1
            seq.metrics.num_drafted += 1
            self.stats.num_drafted += 1
            return None
        toks = extra[4:5 + P][:count]
        lps = extra[5 + P:6 + 2 * P][:count].astype(np.int32).view(np.float32)
        layers = extra[6 + 2 * P:7 + 3 * P][:count]
        k = seq.num_draft
        dropped = k + 1 - count  # rejected drafts and this step's slot beyond the kept ones
        del seq.output_token_ids[idx - k:]
        seq.num_computed -= dropped
        seq.num_draft = 0
        seq.metrics.num_accepted += count - 1
        self.stats.num_accepted += count - 1
        new_text = ""
        for t, lp, layer in zip(toks.tolist(), lps.tolist(), layers.tolist(), strict=True):
            seq.output_token_ids.append(t)
            seq.logprobs.append(lp)
            seq.exit_layers.append(layer)
            self.stats.token_exit_counts[layer] = self.stats.token_exit_counts.get(layer, 0) + 1
            self.stats.num_generated_tokens += 1
            if seq.metrics.first_token_time is None:
                seq.metrics.first_token_time = now
            new_text += self._check_stop(seq, t, len(seq.output_token_ids))
            if seq.finished:
                break
        if seq.finished:  # (a later step's token in flight is dropped with it)
            seq.metrics.finish_time = now
            self.scheduler.release(seq)
            self.input_batch.remove(seq.seq_id)
            self._requests.pop(seq.request_id, None)
        else:
            seq.output_token_ids += later
            if dropped:  # the slot mirrors the rolled-back request
                self.input_batch.rollback(seq.seq_id, dropped)
        return self._output(seq, new_text)

    def _check_stop(self, seq: Sequence, token: int, n_out: int) -> str:
        """Append the token (the request's n_out-th) to the text, decide whether the sequence
        is done; returns the new text."""
        p = seq.params
        is_eos = token in self._eos and not p.ignore_eos
        old_len = len(seq.text)
        if seq.detokenizer is not None and not is_eos and token not in p.stop_token_ids:
            seq.text += seq.detokenizer.push(token)
        if is_eos or token in p.stop_token_ids:
            seq.finish_reason = "stop"
        elif p.stop and len(seq.text) > old_len:
            start = max(0, old_len - max(map(len, p.stop)) + 1)
            hits = [i for i in (seq.text.find(s, start) for s in p.stop) if i >= 0]
            if hits:  # the stop string itself is not part of the output (vLLM's default)
                seq.text = seq.text[:min(hits)]
                seq.finish_reason = "stop"
        new_text = seq.text[old_len:]
        if not seq.finished and (n_out >= p.max_tokens or 0 < len(p.forced_tokens) <= n_out
                                 or len(seq.prompt_token_ids) + n_out
                                 >= self.config.scheduler.max_model_len):
            seq.finish_reason = "length"
        if seq.finish_reason == "length" and seq.detokenizer is not None:
            seq.text += seq.detokenizer.finish()  # flush a trailing partial character
        return new_text

    def _output(self, seq: Sequence, new_text: str) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id, prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids, text=seq.text,
            # only tokens the host has read (a later step's PENDING token is not output)
            token_ids=seq.output_token_ids[:len(seq.exit_layers)], finished=seq.finished,
            finish_reason=seq.finish_reason, error=seq.error,
            logprobs=list(seq.logprobs) if seq.params.logprobs else None,
            exit_layers=list(seq.exit_layers), metrics=seq.metrics, new_text=new_text,
            predicted_token_ids=(list(seq.predicted_token_ids) if seq.params.forced_tokens
                                 else None))

    # -- several processes -------------------------------------------------------------

    def follow(self) -> int:
        """On a follower process (not process 0): run the leader's steps until it stops
        (`ee_jax.serving.distributed`). Returns the number of steps run."""
        return self.runner.follow()

    def stop_followers(self) -> None:
        """On the leader: tell the followers no step follows."""
        self.runner.stop_followers()

    # -- compiling ahead -------------------------------------------------------------------

    def step_shapes(self, kinds: tuple[str, ...] = ("decode", "prefill")) -> list[StepShape]:
        """Every step shape the scheduler can produce (of these kinds; decode also at full
        depth where the exit controller may pick it), smallest batch first: the order a
        warm-up compiles them in, so that what one short request meets (the smallest batch
        bucket's prefill and decode steps) is ready first (`ee_jax.serving.server.startup`)."""
        shapes = self.scheduler.config.step_shapes(kinds)
        if self.controller is not None and self.controller.config.mode != "exits":
            # the full-depth decode programs the controller may run instead
            shapes += [dataclasses.replace(s, exits=False) for s in shapes
                       if s.kind == "decode"]
        return sorted(shapes, key=lambda s: (s.batch, s.kind != "prefill", s.tokens, s.pages,
                                             not s.exits))

    def is_compiled(self, shape: StepShape) -> bool:
        """Whether a step of `shape` runs without compiling (any thread may ask)."""
        return shape in self.runner.traces

    def precompile(self, kinds: tuple[str, ...] = ("decode", "prefill"), *,
                   shapes: list[StepShape] | None = None, progress: bool = True,
                   program_cache: str | None = None,
                   on_program: Callable[[int, int], None] | None = None) -> int:
        """Compile every step shape the scheduler can produce (`step_shapes(kinds)`, or
        `shapes`: a warm-up in parts) now, so no request waits for a compile mid-run;
        returns how many programs that took (shapes compiled before are skipped). XLA
        compiles several at once, on the host's cores (`compilation.pipelined`). With
        `program_cache` (a folder: `compilation.program_cache_dir()` is the one beside the
        persistent cache), each program is loaded from there when an earlier run kept it,
        with no tracing, and kept there when compiled: a restarted server is ready in
        seconds. `on_program(ready, total)` is called as each program is ready (a server's
        /health reports it; an exception it raises stops the warm-up). Not across processes
        of one engine (`distributed`): each compiles."""
        shapes = [s for s in (self.step_shapes(kinds) if shapes is None else shapes)
                  if not self.is_compiled(s)]
        store = ProgramCache(program_cache) if program_cache and \
            not distributed.is_multiprocess() else None
        done = loaded = 0

        def ready(n: int) -> None:
            nonlocal done
            done += n
            bar.update(n)
            if on_program is not None and n:
                on_program(done, len(shapes))

        t0 = time.perf_counter()
        missing = shapes
        try:
            with tqdm(total=len(shapes), desc="compiling steps", unit="program",
                      file=sys.stderr, disable=not progress, leave=False) as bar:
                if store is not None:
                    bar.set_description("loading steps")
                    missing = []
                    for shape, hit in pipelined(
                            shapes, lambda s: s,
                            lambda s: (s, self.runner.load_program(s, store))):
                        missing += [] if hit else [shape]
                        loaded += hit
                        ready(int(hit))
                        check_memory_maps(len(self.runner.traces))
                    bar.set_description("compiling steps")
                for _ in pipelined(missing, lambda s: (s, self.runner.lower(s)),
                                   lambda sl: self.runner.keep_program(*sl, store)):
                    ready(1)
                    check_memory_maps(len(self.runner.traces))
        finally:
            self.stats.compile_time += time.perf_counter() - t0
            self.stats.num_compiles += done - loaded
            self.stats.num_programs_loaded += loaded
        return len(shapes)

    # -- introspection -----------------------------------------------------------------

    @property
    def num_compiled_programs(self) -> int:
        return len(self.runner.traces)

    @property
    def kv_cache_bytes(self) -> int:
        return self.runner.cache.nbytes

    def pages_per_seq(self) -> int:
        return self.scheduler.config.pages_per_seq
