"""The jitted model step over the paged cache, and the host<->device packing around it.

Every step is `ee_jax.serving.step.model_step` under the policy its kind asks for (prefill:
full depth; decode: the engine's exit policy), followed by sampling. Programs are keyed by
a `StepShape` (kind, batch, tokens, page-table width) drawn from a small set of buckets, so
steady state never recompiles.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, SingleDeviceSharding

from ee_jax.models import llama, quant
from ee_jax.models.config import ModelConfig
from ee_jax.models.exits.config import ExitConfig, served_min_row_bucket
from ee_jax.models.exits.heads import check_heads, init_heads, unstack_heads, with_vocab_rows
from ee_jax.serving import attention_kernels, distributed, layouts, sharding
from ee_jax.serving.attention import AttentionMetadata
from ee_jax.serving.compilation import ProgramCache, abstract_signature
from ee_jax.serving.kv_cache import NULL_PAGE, KVCache
from ee_jax.serving.sampling import (
    SamplingTensors,
    draft_kept,
    residual_sample,
    sample,
    token_logprobs,
)
from ee_jax.serving.step import Pending, model_step, policy_for, run_widths

# Tokens per query block of a ragged prefill step (architecture.md section 5): each row's
# chunk but its last token is padded to a multiple of this, so a block belongs to one row.
# Padding costs at most QUERY_BLOCK - 1 tokens a row; attention runs per block.
QUERY_BLOCK = 32


def query_blocks(num_tokens: int) -> int:
    """Query blocks a chunk of `num_tokens` takes in a prefill step: all but its last token,
    which rides in the row's own slot."""
    return -(-(num_tokens - 1) // QUERY_BLOCK)


@dataclasses.dataclass(frozen=True)
class StepShape:
    """Static shape of one compiled step: B rows, `tokens`, W pages per row, and the step's
    kind: "prefill" (prompt tokens, always full depth) or "decode" (one token per row, under
    the engine's exit policy). The kind, never the token count, decides.

    Every row has one token of its own (the one sampled). `tokens` is 1 for decode; for
    prefill it is N, the tokens packed in query blocks besides (the rest of the rows' chunks:
    a multiple of QUERY_BLOCK, 0 when every chunk is one token), so a prefill step runs
    N + B tokens, never B x the longest chunk."""

    batch: int
    tokens: int
    pages: int
    kind: str = "decode"
    # decode only: False runs the full-depth program (no checks compiled in) where the exit
    # controller found that checks do not pay (`ee_jax.serving.controller`)
    exits: bool = True

    def __post_init__(self):
        if self.kind not in ("prefill", "decode"):
            raise ValueError(f"StepShape.kind must be 'prefill' or 'decode', got {self.kind!r}")
        if self.kind == "decode" and self.tokens != 1:
            raise ValueError(f"a decode step has one token per row, got tokens={self.tokens}")
        if self.kind == "prefill" and (self.tokens < 0 or self.tokens % QUERY_BLOCK):
            raise ValueError(f"a prefill step's packed tokens are a multiple of QUERY_BLOCK "
                             f"({QUERY_BLOCK}), got tokens={self.tokens}")

    @property
    def block_tokens(self) -> int:
        """N: tokens in query blocks (0 for decode)."""
        return self.tokens if self.kind == "prefill" else 0

    # Layout of the single int32 host buffer (floats are bit-cast into it).
    def _fields(self) -> tuple[tuple[str, int], ...]:
        B, N, W = self.batch, self.block_tokens, self.pages
        return (("tokens", B), ("positions", B), ("block_tokens", N),
                ("block_positions", N), ("block_rows", N // QUERY_BLOCK),
                ("page_table", B * W), ("kv_lens", B), ("seeds", B), ("sample_idx", B),
                ("top_k", B), ("temperature", B), ("top_p", B), ("threshold", B),
                ("src_row", B), ("pend_row", B))

    @property
    def size(self) -> int:
        return sum(n for _, n in self._fields())


@dataclasses.dataclass
class StepBatch:
    """Host-side inputs of one step, already padded to a StepShape."""

    shape: StepShape
    tokens: np.ndarray  # [B, 1] int32, each row's token (the last of its chunk: sampled)
    positions: np.ndarray  # [B, 1] int32
    block_tokens: np.ndarray  # [N] int32, the rest of the chunks, in query blocks
    block_positions: np.ndarray  # [N] int32; padding: a position >= its row's kv_len
    block_rows: np.ndarray  # [N / QUERY_BLOCK] int32, the row of each block; -1: padding
    page_table: np.ndarray  # [B, W] int32
    kv_lens: np.ndarray  # [B] int32 (0 for padding rows)
    seeds: np.ndarray  # [B] int32
    sample_idx: np.ndarray  # [B] int32, how many tokens the request has sampled so far
    top_k: np.ndarray  # [B] int32
    temperature: np.ndarray  # [B] f32
    top_p: np.ndarray  # [B] f32
    threshold: np.ndarray  # [B] f32, early-exit confidence threshold of each row
    # [B] int32: rows whose token the previous step sampled and the host has not read yet
    # take it from that step's device result, row src_row; -1: `tokens` holds it
    src_row: np.ndarray
    # [B] int32: the row's previous token was row pend_row of the latest decode step, and no
    # prefill step ran the row since (back-fill "deferred" completes that token here if it
    # left early); -1: it was not
    pend_row: np.ndarray

    @classmethod
    def empty(cls, shape: StepShape) -> StepBatch:
        B, N, W = shape.batch, shape.block_tokens, shape.pages
        return cls(shape, np.zeros((B, 1), np.int32), np.zeros((B, 1), np.int32),
                   np.zeros(N, np.int32), np.zeros(N, np.int32),
                   np.full(N // QUERY_BLOCK, -1, np.int32),
                   np.full((B, W), NULL_PAGE, np.int32), np.zeros(B, np.int32),
                   np.zeros(B, np.int32), np.zeros(B, np.int32),
                   np.zeros(B, np.int32), np.zeros(B, np.float32), np.ones(B, np.float32),
                   np.zeros(B, np.float32), np.full(B, -1, np.int32),
                   np.full(B, -1, np.int32))

    def pack(self) -> np.ndarray:
        """Everything in one int32 buffer: one host-to-device transfer per step."""
        parts = []
        for name, n in self.shape._fields():
            a = np.asarray(getattr(self, name))
            if a.dtype == np.float32:
                a = a.view(np.int32)
            parts.append(a.astype(np.int32, copy=False).reshape(n))
        return np.concatenate(parts)


def unpack(shape: StepShape, buf: jax.Array) -> dict[str, jax.Array]:
    B, W = shape.batch, shape.pages
    out, off = {}, 0
    for name, n in shape._fields():
        a = buf[off:off + n]
        off += n
        if name in ("temperature", "top_p", "threshold"):
            a = jax.lax.bitcast_convert_type(a, jnp.float32)
        if name in ("tokens", "positions"):
            a = a.reshape(B, 1)
        elif name == "block_positions":
            a = a.reshape(-1, QUERY_BLOCK)
        elif name == "page_table":
            a = a.reshape(B, W)
        out[name] = a
    return out


_KINDS = ("decode", "prefill")


def sampling_tensors(inp: dict[str, jax.Array]) -> SamplingTensors:
    return SamplingTensors(temperature=inp["temperature"], top_k=inp["top_k"],
                           top_p=inp["top_p"], seeds=inp["seeds"].astype(jnp.uint32),
                           steps=inp["sample_idx"])


def pack_results(tokens: jax.Array, logprobs: jax.Array, *extra: jax.Array) -> jax.Array:
    """One small int32 array [B, 2 + columns of extra] back to the host (logprobs bit-cast);
    an extra [B] is one column, [B, n] n columns."""
    cols = [tokens.astype(jnp.int32)[:, None],
            jax.lax.bitcast_convert_type(logprobs, jnp.int32)[:, None]]
    cols += [e.astype(jnp.int32).reshape(e.shape[0], -1) for e in extra]
    return jnp.concatenate(cols, axis=1)


def _place(tree: Any, where: Any) -> Any:
    """`tree` on `where` (a sharding, or a tree of them): arrays are put there; abstract leaves
    (`jax.ShapeDtypeStruct`, compiling for another machine) get the sharding attached."""
    def one(a, s):
        if isinstance(a, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
        return sharding.shard(a, s)

    if isinstance(where, jax.sharding.Sharding):
        return jax.tree.map(lambda a: one(a, where), tree)
    return jax.tree.map(one, tree, where)


def unpack_results(out: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    out = np.asarray(out)
    return out[:, 0], out[:, 1].view(np.float32), out[:, 2:]


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Everything static about a step program but its shape: runners of one StepConfig share
    one jitted function (`step_program`), so a second engine of the same model, exit settings,
    attention backend, platform and mesh compiles nothing the first one compiled.

    Whatever a trace of the step depends on is here (or in its shape and arguments): the
    platform the step is built for and the backend resolved on it are fields, not state of
    the process read while tracing, so a cached program is never one traced for another
    platform (a TPU step traced on a CPU host by `aot` is keyed as the TPU's)."""

    model: ModelConfig  # the model the step runs
    exit_config: ExitConfig | None  # decode steps' exits (None: full depth only)
    # the attention backend, a concrete name ("auto" is resolved on `platform` where the
    # config is built: `attention_kernels.backend_name`)
    attention: str
    # the platform the step is built for ("cpu", "gpu", "tpu"): it decides how the learned
    # back-fill maps are read (`backfill_maps.gathers`) and which backends may run
    platform: str
    mesh: Mesh | None  # the devices a sharded step runs on; None: one device
    # TPU without a mesh: the pool's formats (a KVCache of them) the step returns the donated
    # cache in, the ones it took it in (`ModelRunner(layout_shape=...)`); None: the default
    cache_format: Any = None

    def __post_init__(self):
        if self.attention == "auto":
            raise ValueError("StepConfig.attention is a concrete backend: resolve 'auto' "
                             "with attention_kernels.backend_name(name, platform)")
        if not self.platform or self.platform != self.platform.lower():
            raise ValueError(f"StepConfig.platform is a lower-case platform name ('cpu', "
                             f"'gpu', 'tpu'), got {self.platform!r}")
        attention_kernels.backend_name(self.attention, self.platform)  # runs there


class StepProgram:
    """The jitted step of one StepConfig: `jitted(shape, params, heads, cache, buf,
    last_tokens, pending)` with the cache and the pending runs donated (each step's
    state is the next step's alone). `traces` counts traces per StepShape."""

    def __init__(self, config: StepConfig):
        self.config = config
        self.traces: collections.Counter[StepShape] = collections.Counter()
        jit_kw: dict[str, Any] = {}
        if config.mesh is not None:
            rep = sharding.replicated(config.mesh)
            jit_kw["out_shardings"] = (sharding.cache_sharding(config.model, config.mesh),
                                       rep, rep, rep)
        if config.cache_format is not None:
            dev = config.cache_format.k.sharding
            jit_kw["out_shardings"] = (config.cache_format, dev, dev, dev)
        self.jitted = jax.jit(self._impl, static_argnums=(0,), donate_argnums=(3, 6),
                              **jit_kw)

    def _impl(self, shape: StepShape, params, heads, cache: KVCache, buf: jax.Array,
              last_tokens: jax.Array, pending: Pending):
        self.traces[shape] += 1  # runs only while tracing
        c = self.config
        inp = unpack(shape, buf)
        tokens = inp["tokens"]
        # Rows whose token the previous step sampled read it from the device.
        src = inp["src_row"]
        prev = inp["pend_row"]  # rows of the latest decode step, or -1
        at = jnp.clip(prev, 0, pending.layer.shape[0] - 1)
        # verified exits: a row whose verify (in the step the host has not read) dropped
        # drafts is that many positions behind what the host counted
        rb = jnp.where((src >= 0) & (prev >= 0), pending.rollback[at], 0)
        inp = dict(inp, positions=inp["positions"] - rb[:, None],
                   kv_lens=jnp.where(inp["kv_lens"] > 0, inp["kv_lens"] - rb, 0),
                   sample_idx=inp["sample_idx"] - rb)
        from_device = last_tokens[jnp.clip(src, 0, last_tokens.shape[0] - 1)]
        tokens = tokens.at[:, 0].set(jnp.where(src >= 0, from_device, tokens[:, 0]))
        if c.mesh is not None and c.mesh.shape["dp"] > 1:  # rows over dp
            tokens = jax.lax.with_sharding_constraint(tokens,
                                                      sharding.batch_sharding(c.mesh, 2))
        blocks = shape.block_tokens > 0
        meta = AttentionMetadata(inp["positions"], inp["page_table"], inp["kv_lens"],
                                 inp["block_positions"] if blocks else None,
                                 inp["block_rows"] if blocks else None)
        policy = policy_for(c.exit_config if shape.exits else None, shape.kind)
        none = Pending.none(shape.batch, c.model, pending.width, pending.q.shape[-1])
        rows_pending = jax.tree.map(
            lambda a, n: jnp.where((prev >= 0).reshape(-1, *[1] * (a.ndim - 1)), a[at], n),
            pending, none)
        result, cache = model_step(params, heads, cache, tokens, meta, inp["threshold"],
                                   c.model, policy, c.attention,
                                   block_tokens=inp["block_tokens"] if blocks else None,
                                   pending=rows_pending, platform=c.platform)
        st = sampling_tensors(inp)
        if result.run_logits is not None:  # verified exits: drafts, or a verify
            sampled, logprobs, emitted, result = _verify(result, rows_pending, st, c.model)
        else:
            sampled = sample(result.logits, st)
            logprobs = token_logprobs(result.logits, sampled)
            emitted = ()
        last_tokens = jnp.zeros_like(last_tokens).at[:shape.batch].set(sampled)
        if shape.kind == "decode":  # a prefill step leaves the latest decode step's pending
            # tokens where they are (its rows' own are dropped: InputBatch never asks again)
            new = result.pending if result.pending.shapes == none.shapes else none
            if new.q.shape[-1]:  # "rejection": the in-place write of q after every read
                # of the old q (the residual's, late): XLA orders a buffer's in-place write
                # after the reads it depends on, and otherwise copies the whole state
                # ([max_batch, P, V]) first; optimization barriers do not survive to that
                # point on CPU. `sampled` is never negative, which XLA cannot know.
                new = dataclasses.replace(new, q=jnp.where(jnp.min(sampled) < 0, 0.0, new.q))
            # written in place (the state is donated): rows past this step's are never
            # read (the next step's rows that ride along were this step's)
            pending = jax.tree.map(lambda a, n: a.at[:shape.batch].set(n), pending, new)
        return cache, pack_results(sampled, logprobs, result.exit_layer,
                                   *(jnp.broadcast_to(a, sampled.shape)
                                     for a in (result.checks, result.work)),
                                   *emitted), last_tokens, pending


def _verify(result, run: Pending, st: SamplingTensors, cfg: ModelConfig):
    """Draft or verify each row of a verified-exits step (docs/early_exit.md, "Verified exits").

    Every position is sampled as full depth samples it: the same per-request key (seed,
    token index), the same filters, Gumbel-max over the logits; a draft is the exit head's
    sample under that key. How a verify checks a draft (`ExitConfig.verify_sampling`):
    "coupled" keeps it exactly where the final head's sample under the same key, the full
    model's token there, agrees (greedy: equal argmaxes), so the emitted tokens are *the*
    tokens full depth emits with that seed, whatever shares the batch; "rejection" is
    standard speculative sampling (`sampling.draft_kept`, `residual_sample`; the run's q
    carried in `run.q`), which keeps more drafts, at the full model's distribution but not
    its seeded tokens. Both take the full model's sample at the row's own position (a verifying row
    ran every layer for it).

    Returns (each row's next input token [B], its logprob [B], the emitted columns
    (count [B], tokens [B, P + 1], logprobs [B, P + 1] (bit-cast), exit layers [B, P + 1]),
    the result with the drafts filled into its pending run)."""
    L = cfg.n_layers
    B, P = run.token.shape
    rejection = run.q.shape[-1] > 0
    j = jnp.arange(P + 1, dtype=jnp.int32)
    left = (result.exit_layer > 0) & (result.exit_layer < L)  # drafting rows
    verified = result.exit_layer == L

    valid = run.token >= 0  # [B, P], right aligned

    def last_slots(w: int):
        """At the runs' last w entries and the rows' own positions: coupled, the full
        model's samples [B, P + 1]; whether each entry's draft is kept [B, P]; the final
        head's log-normaliser at each position [B, P + 1] (for the emitted logprobs)."""
        def f():
            def slots(a, own):  # [B, w + 1, ...] -> [B * (w + 1), ...]
                both = jnp.concatenate([a[:, P - w:], own[:, None].astype(a.dtype)], axis=1)
                return both.reshape(B * (w + 1), *a.shape[2:])

            logits = slots(result.run_logits, result.logits)
            rep = SamplingTensors(*(jnp.repeat(a, w + 1) for a in (
                st.temperature, st.top_k, st.top_p, st.seeds)),
                steps=jnp.maximum(st.steps[:, None] - w + j[:w + 1], 0).reshape(-1))
            drafts = jnp.maximum(slots(run.token, jnp.zeros((B,), jnp.int32)), 0)
            if rejection:  # the tokens are chosen below, where the first draft is dropped
                kept = draft_kept(logits, slots(run.q, result.logits), drafts, rep)
                full = drafts
            else:
                full = sample(logits, rep)
                kept = drafts == full
            lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
            return (jnp.zeros((B, P + 1), jnp.int32).at[:, P - w:].set(full.reshape(B, w + 1)),
                    jnp.zeros((B, P), bool).at[:, P - w:].set(kept.reshape(B, w + 1)[:, :w]),
                    jnp.zeros((B, P + 1), jnp.float32).at[:, P - w:].set(lse.reshape(B, w + 1)))
        return f

    # as many slots as the longest verifying run needs, bucketed as the step's head was
    widths = run_widths(P)
    need = jnp.max(jnp.where(verified, jnp.sum(valid, axis=1), 0))
    full, kept, lse = jax.lax.switch(jnp.searchsorted(jnp.asarray(widths), need),
                                     [last_slots(w) for w in widths])
    match = kept | ~valid
    first_miss = jnp.argmin(jnp.concatenate([match, jnp.zeros((B, 1), bool)], axis=1), axis=1)
    if rejection:  # kept drafts, then the residual's sample where one was dropped, else the
        # full model's at the row's own position (a drafting row's: its draft)
        own = sample(result.logits, st)
        at = jnp.minimum(first_miss, P - 1)
        resid = residual_sample(
            jnp.take_along_axis(result.run_logits, at[:, None, None], axis=1)[:, 0],
            jnp.take_along_axis(run.q, at[:, None, None], axis=1)[:, 0],
            dataclasses.replace(st, steps=jnp.maximum(st.steps - P + at, 0)))
        miss = jnp.where(first_miss < P, resid, own)
        full = jnp.where(j[None] == first_miss[:, None], miss[:, None],
                         jnp.concatenate([jnp.maximum(run.token, 0), own[:, None]], axis=1))
    both = jnp.concatenate([result.run_logits, result.logits[:, None]], axis=1)  # [B, P+1, V]
    lps = jnp.take_along_axis(both, full[..., None], axis=-1)[..., 0] - lse
    start = P - jnp.sum(valid, axis=1)  # the run's first entry
    count = jnp.where(verified, first_miss - start + 1, 0)  # kept drafts + the full token
    idx = jnp.minimum(start[:, None] + j, P)  # [B, P + 1]
    tokens = jnp.take_along_axis(full, idx, axis=1)
    logprobs = jnp.take_along_axis(lps, idx, axis=1)
    made_by = jnp.concatenate([run.exit, jnp.full((B, 1), L, jnp.int32)], axis=1)
    layers = jnp.where(j[None] < count[:, None] - 1, jnp.take_along_axis(made_by, idx, axis=1),
                       L)
    at = jnp.where(verified, first_miss, P)[:, None]
    nxt = jnp.take_along_axis(full, at, axis=1)[:, 0]
    nxt_lp = jnp.take_along_axis(lps, at, axis=1)[:, 0]
    dropped = jnp.sum(valid, axis=1) + 1 - count  # rejected drafts and beyond: rolled back
    pending = dataclasses.replace(result.pending, token=result.pending.token.at[:, P - 1].set(
        jnp.where(left, full[:, P], -1)), rollback=jnp.where(verified, dropped, 0))
    emitted = (count, tokens, jax.lax.bitcast_convert_type(logprobs, jnp.int32), layers)
    return nxt, nxt_lp, emitted, dataclasses.replace(result, pending=pending)


def layout_shape(shapes: Iterable[StepShape], exits: bool) -> StepShape | None:
    """The step a TPU runner picks its weights', heads' and pool's layouts from: the largest
    decode bucket (the program that moves the most; the smaller ones then take the same
    arrays with no entry copy, tests/test_lowering.py)."""
    decode = [s for s in shapes if s.kind == "decode"]
    if not decode:
        return None
    big = max(decode, key=lambda s: (s.batch, s.pages))
    return dataclasses.replace(big, exits=exits)


# Entry layouts picked per (StepConfig, shape, arguments, device): `ModelRunner._formats`.
_PICKED: dict[tuple, tuple[Any, Any, KVCache]] = {}


@functools.cache
def step_program(config: StepConfig) -> StepProgram:
    """The one step program of `config` in this process (why: a jitted function per runner
    compiled every shape again for every engine, ~68 times over in the test suite)."""
    return StepProgram(config)


class ModelRunner:
    """Owns the params, the cache and the compiled steps; the engine hands it StepBatches.

    With an `ExitConfig`, decode steps run under its exit policy; prefill always runs at full
    depth. Results are [B, 5]: token, logprob (bit-cast), the row's exit layer (the layers
    it ran: its own under "per_row", the batch's under "all"/"quorum", L at full depth; 0 for
    padding rows), how many exit checks projected onto the vocabulary, and the row-layers the
    step computed (rows a layer ran on, summed over layers: B x layers run unless "per_row"
    compacted the rows; B x L at full depth).
    """

    def __init__(self, cfg: ModelConfig, params: llama.Params | dict, cache: KVCache,
                 exit_config: ExitConfig | None = None, exit_heads=None,
                 attention: str = "reference", max_batch: int = 64,
                 mesh: Mesh | None = None, device: jax.Device | None = None,
                 platform: str | None = None, layout_shape: StepShape | None = None,
                 layer_layout: str | None = None):
        """`device`: where a runner without a mesh runs (default: the first local device).
        `platform`: what the steps are built for (default: the devices'), read here once: it
        resolves `attention` ("auto" included) and goes into the step's static config
        (`StepConfig.platform`), and decides whether policy "per_row" compacts its rows
        (`min_row_bucket`).
        `layer_layout` (`llama.LAYOUTS`; None: the platform's, `llama.layout_for`): how the
        steps hold the layers' weights, "per_layer" a buffer a weight a layer.
        `layout_shape` (TPU, no mesh): the weights, heads and pool are placed in the device
        layouts the step of that shape wants (`layouts.pick`; the engine gives its largest
        decode bucket, `layout_shape()`): in XLA's default ones every SmolLM2 decode step
        copied the 1 GiB pool in and out, and batch >= 2 the embedding (docs/roofline.md).
        Abstract params, heads and cache (`jax.ShapeDtypeStruct` leaves, as
        `ee_jax.serving.aot.compile` builds them) make a runner that can only `lower` and `compile`,
        for a device this machine may not have: nothing is allocated."""
        platform = platform or (mesh.devices.flat[0] if mesh is not None else
                                device or jax.local_devices()[0]).platform
        attention = attention_kernels.backend_name(attention, platform)
        # what a caller passes (a mapping of weight keys too) as Params, held to cfg's shapes
        params = llama.check_params(cfg, params, source="the params given")
        params = quant.for_platform(params, platform)  # a GGUF's blocks as this target reads
        if exit_config is not None and exit_config.policy == "per_row":
            exit_config = dataclasses.replace(exit_config, min_row_bucket=served_min_row_bucket(
                platform, max_batch, exit_config.min_row_bucket))
        abstract = any(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(params))
        self.cfg = cfg
        self.mesh = mesh
        self.cache = cache
        self.exit_config = exit_config
        self.attention = attention
        if exit_config is not None:
            exit_config.validate_for(cfg)
            if exit_heads is None:
                exit_heads = init_heads(cfg, exit_config, params)
            exit_heads = check_heads(cfg, exit_config, exit_heads)
            # The subset's LM-head rows gathered once here, not in every step's first check.
            exit_heads = jax.eval_shape(lambda p, h: with_vocab_rows(p, h, cfg), params,
                                        exit_heads) \
                if abstract else with_vocab_rows(params, exit_heads, cfg)
        self.params, self.exit_heads = params, exit_heads
        cache_format = None
        if mesh is not None:  # shardings from the logical-axis table (ee_jax.serving.sharding)
            self.params = _place(params, sharding.param_shardings(params, cfg, mesh))
            if exit_heads is not None:
                self.exit_heads = _place(
                    exit_heads, sharding.param_shardings(exit_heads, cfg, mesh))
        else:  # every argument committed to the device from the start (no copy): jit keys
            # its programs on whether an argument is committed, and the donated cache comes
            # back committed after the first step (and an exit engine's heads may be), so
            # the second step of a shape compiled again, uncounted (exit engines' first run)
            device = device or jax.local_devices()[0]
            where = SingleDeviceSharding(device)
            if layout_shape is not None and platform == "tpu":
                where = self._formats(layout_shape, where, exit_config, attention, max_batch,
                                      platform)
            self.params, self.exit_heads, self.cache = _place(
                (self.params, self.exit_heads, self.cache), where)
            cache_format = where[2] if isinstance(where, tuple) else None
        self.layer_layout = layer_layout or llama.layout_for(platform)
        if self.layer_layout == "per_layer":  # placed first: each layer's slice keeps its
            # sharding (under a mesh, the stacked spec less the layer axis)
            self.params = llama.unstack_layers(self.params)
            self.exit_heads = unstack_heads(self.exit_heads)  # an exit's parts as its buffers
        # The shapes this runner has run or compiled, each with the traces that took (0: the
        # shared program had it already; more than 1 would be a recompile).
        self.traces: dict[StepShape, int] = {}
        self.max_batch = max_batch
        # The last step's sampled tokens, on the device, padded to max_batch: the next step
        # reads its decode rows' inputs from here before the host has seen them.
        # The latest step's tokens that left early, for back-fill "deferred": the next decode
        # step runs their skipped layers beside the rows' own tokens (step.Pending).
        def state():
            return jnp.zeros((max_batch,), jnp.int32), Pending.for_config(
                max_batch, cfg, exit_config)

        self.last_tokens, self.pending = _place(
            jax.eval_shape(state) if abstract else state(),
            SingleDeviceSharding(device) if mesh is None else sharding.replicated(mesh))
        self.program = step_program(StepConfig(cfg, exit_config, attention, platform,
                                               mesh, cache_format))
        self._step = self.program.jitted
        # The devices the steps run on, in the order the programs are compiled for.
        self.devices: list[jax.Device] = list(mesh.devices.flat) if mesh is not None else \
            [device]
        # Compiled programs this runner holds itself (`precompile` compiled or loaded them):
        # steps of these shapes call them directly, bypassing jit's trace/lowering caches.
        self._programs: dict[StepShape, jax.stages.Compiled] = {}

    def _formats(self, shape: StepShape, where: jax.sharding.Sharding,
                 exit_config: ExitConfig | None, attention: str, max_batch: int,
                 platform: str) -> tuple[Any, Any, KVCache]:
        """(params, heads, cache) formats the step of `shape` takes with no entry copy
        (`layouts.pick`: a few compiles of that step, once per configuration and process)."""
        cfg = self.cfg

        def sds(t):
            return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                               sharding=where), t)

        def state():
            return jnp.zeros((max_batch,), jnp.int32), Pending.for_config(
                max_batch, cfg, exit_config)

        last, pend = jax.eval_shape(state)
        args = (sds(self.params), sds(self.exit_heads), sds(self.cache),
                jax.ShapeDtypeStruct((shape.size,), jnp.int32, sharding=where), sds(last),
                sds(pend))
        key = (StepConfig(cfg, exit_config, attention, platform, None), shape,
               abstract_signature(args), where)
        if key not in _PICKED:
            prog = StepProgram(key[0])
            # A head-major pool stays in the default layout, the kernels': with the pool's
            # layout left to XLA, it fed the kernel a relayout of the whole pool each layer.
            auto = (0, 1) if self.cache.head_major else (0, 1, 2)
            if self.cache.head_major:
                args = (*args[:2], layouts.place(args[2], layouts.default_formats(args[2])),
                        *args[3:])
            picked = layouts.pick(functools.partial(prog._impl, shape), args, auto,
                                  donate_argnums=(2,), returned={0: 2})
            if self.cache.head_major:  # the pool as pinned above
                picked = (*picked, jax.tree.map(lambda a: a.format, args[2]))
            _PICKED[key] = picked
        return _PICKED[key]

    def step(self, batch: StepBatch) -> Any:
        """Launch a step without waiting for it; returns the device result (read it with
        `unpack_results(np.asarray(r))`, which waits). Several processes: the leader calls
        this, and it broadcasts the step to the followers (`follow`) first."""
        if batch.shape.batch > self.max_batch:
            raise ValueError(f"a step of {batch.shape.batch} rows exceeds max_batch "
                             f"{self.max_batch}")
        buf = batch.pack()
        if distributed.is_multiprocess():
            s = batch.shape
            distributed.broadcast_header(np.asarray(
                [distributed.GO, s.batch, s.tokens, s.pages,
                 _KINDS.index(s.kind) + (0 if s.exits else len(_KINDS))], np.int32))
            distributed.broadcast_buffer(buf, s.size)
        out = self._launch(batch.shape, buf)
        return out.addressable_data(0) if distributed.is_multiprocess() else out

    def _launch(self, shape: StepShape, buf: np.ndarray) -> jax.Array:
        if self.mesh is None:
            dev = jax.device_put(buf)  # a transfer (jnp.asarray compiles per shape)
        else:
            dev = sharding.shard(buf, sharding.replicated(self.mesh))
        program = self._programs.get(shape)
        step = functools.partial(self._step, shape) if program is None else program
        with self._tracing(shape), \
                contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh):
            self.cache, out, self.last_tokens, self.pending = step(
                self.params, self.exit_heads, self.cache, dev, self.last_tokens, self.pending)
        return out

    @contextlib.contextmanager
    def _tracing(self, shape: StepShape):
        """Count in `traces` the traces of `shape` that happen inside (the program is shared:
        its own count includes other runners')."""
        n0 = self.program.traces[shape]
        try:
            yield
        finally:
            self.traces[shape] = self.traces.get(shape, 0) + self.program.traces[shape] - n0

    def follow(self) -> int:
        """A follower process's loop: run every step the leader broadcasts, until it stops.
        Returns the number of steps run."""
        n = 0
        while True:
            go, b, t, w, kind = distributed.broadcast_header(None).tolist()
            if go == distributed.STOP:
                return n
            shape = StepShape(b, t, w, kind=_KINDS[kind % len(_KINDS)],
                              exits=kind < len(_KINDS))
            self._launch(shape, distributed.broadcast_buffer(None, shape.size))
            n += 1

    def stop_followers(self) -> None:
        """The leader's word that no step follows (followers' `follow` returns)."""
        if distributed.is_multiprocess() and distributed.is_leader():
            distributed.broadcast_header(np.zeros(5, np.int32))

    def lower(self, shape: StepShape) -> Any:
        """The step of `shape` lowered (`jax.stages.Lowered`), with this runner's arguments."""
        buf = jax.ShapeDtypeStruct((shape.size,), jnp.int32)
        with self._tracing(shape), \
                contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh):
            return self._step.lower(shape, self.params, self.exit_heads, self.cache, buf,
                                    self.last_tokens, self.pending)

    def compile(self, shape: StepShape) -> None:
        """Compile the step of `shape` ahead of time, without running it (jit reuses the
        compiled program when a batch of that shape comes)."""
        self.compile_lowered(self.lower(shape))

    def compile_lowered(self, lowered: Any) -> Any:
        """Compile a program `lower` gave (any thread: `compilation.pipelined`)."""
        with contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh):
            return lowered.compile()

    # -- the program cache (`compilation.ProgramCache`): a restart loads, never traces ------

    def program_key(self, store: ProgramCache, shape: StepShape) -> str:
        """The key of this runner's program of `shape`: the static step configuration, the
        shape, the arguments' tree, shapes, dtypes and placement, and the devices."""
        args = (self.params, self.exit_heads, self.cache, self.last_tokens, self.pending)
        return store.key(self.program.config, shape, abstract_signature(args),
                         [(d.id, d.device_kind, d.platform) for d in self.devices])

    def load_program(self, shape: StepShape, store: ProgramCache) -> bool:
        """Take the program of `shape` from `store` if it holds it (any thread)."""
        compiled = store.load(self.program_key(store, shape), self.devices)
        if compiled is not None:
            self._programs[shape] = compiled
            self.traces.setdefault(shape, 0)
        return compiled is not None

    def keep_program(self, shape: StepShape, lowered: Any,
                     store: ProgramCache | None = None) -> jax.stages.Compiled:
        """Compile `lowered` (`lower(shape)`'s, any thread), run its steps through it from
        now on, and save it in `store`."""
        compiled = self.compile_lowered(lowered)
        self._programs[shape] = compiled
        if store is not None:
            store.save(self.program_key(store, shape), compiled)
        return compiled

    @property
    def num_traces(self) -> int:
        """Traces this runner's steps took (its shapes' compiles; other runners' not)."""
        return sum(self.traces.values())
