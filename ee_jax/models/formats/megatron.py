"""EE-LLM and EE-Tuning checkpoints (Megatron-LM) -> ee-jax params, exits and exit heads.

The only open decoder-only models trained with early exits (EE-LLM, arXiv 2312.04916; and any
Llama 2 given exits by EE-Tuning, arXiv 2402.00518) exist as Megatron-LM checkpoints:

    <folder>/latest_checkpointed_iteration.txt      the iteration, or "release"
    <folder>/iter_0000001/mp_rank_00/model_optim_rng.pt        (pipeline size 1)
    <folder>/iter_0000001/mp_rank_00_000/model_optim_rng.pt    (tensor rank 00, stage 000)

Each file is a torch pickle: `args` (an argparse.Namespace: the model's shape and its exits),
and the weights under `model` -> `language_model`: `embedding.word_embeddings.weight` (first
stage), `encoder` (`layers.{i}.*`, i local to the stage; `final_norm.weight` on the last),
`output_layer.weight` (last stage, when untied) and `exit_output_layer.{j}.weight` (j counts
the stage's exits). Tensor parallel ranks hold whole KV groups of `query_key_value` (per group:
its q heads, then k, then v), column slices of `dense` and `dense_4h_to_h`, `[gate_r; up_r]`
of `dense_h_to_4h` and row slices of the vocabulary matrices; norms are replicated.

Exits (`args.exit_layer_nums`, 1-based): the exit reads its layer's output, or its input under
`pre_exit`; `exit_norm` (RMSNorm) when `use_exit_norm`; under `use_exit_mlp` the exit layer's MLP
is split into a trunk (the backbone's) and a branch, and the exit reads m + branch(norm(m)),
m the layer's state after attention (ee-jax head "branch"); its own output matrix under
`untie_exit_output_weights`, else the tied embedding. They become an `ExitConfig` and exit
heads (`exit_heads`): exit e of ee-jax is "after e layers", so a post exit at layer n is e = n
and a pre exit is e = n - 1. An exit at the last layer (or a pre exit at the first) has no
place among ee-jax's exits (1 <= e < L) and is dropped with a note. EE-LLM's own inference
does not divide by `exit_layer_temperature`; ee-jax does (the confidence its training
calibrated), which changes nothing for the default temperature 1.

Loading is safe: `torch.load(weights_only=True)` with only the classes the format needs
allowed (argparse.Namespace, a stand-in for Megatron's `ModelType` enum, numpy's array
reconstruction for the RNG state a training checkpoint keeps); a pickle naming anything else
is refused before anything from it runs, with the class named. Megatron is never imported,
tensors are memory-mapped (optimizer state in the same file is never read into memory), and
torch is needed by this loader only (`pip install "ee-jax[megatron]"`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import enum
import functools
import os
import pickle
import re
import sys
import time
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np

from ee_jax.errors import ModelLoadError, UnsupportedModelError
from ee_jax.models.config import ConfigError, ModelConfig
from ee_jax.models.exits.config import ExitConfig
from ee_jax.models.exits.heads import Branch, ExitHeads
from ee_jax.models.llama import Params, ParamsMismatchError, check_params, param_shapes

TRACKER = "latest_checkpointed_iteration.txt"
WEIGHTS = "model_optim_rng.pt"
_RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?$")
_LAYER_KEY = re.compile(r"layers\.(\d+)\.(.+)$")


class ModelType(enum.Enum):
    """Stand-in for `megatron.core.enums.ModelType` (its values), the one class beyond
    Python's and torch's own that a checkpoint's `args` pickle names."""

    encoder_or_decoder = 1
    encoder_and_decoder = 2
    retro_encoder = 3
    retro_decoder = 4


def _torch():
    try:
        import torch
    except ImportError as e:
        raise ModelLoadError("Reading a Megatron (EE-LLM) checkpoint needs torch, which the "
                             "engine itself does not: pip install 'ee-jax[megatron]' (or "
                             "pip install torch), or convert it once where torch is "
                             "installed: ee-jax convert <folder> <out>") from e
    return torch


def _allowed() -> list:
    """What a Megatron checkpoint may ask the unpickler to build (besides torch's defaults)."""
    allowed: list = [argparse.Namespace, (ModelType, "megatron.core.enums.ModelType")]
    # numpy arrays (the RNG state a training checkpoint saves), under both module names
    recon = getattr(np, "_core", np.core).multiarray._reconstruct
    allowed += [(recon, "numpy.core.multiarray._reconstruct"),
                (recon, "numpy._core.multiarray._reconstruct"), np.ndarray, np.dtype]
    allowed += [getattr(np.dtypes, n) for n in dir(np.dtypes) if n.endswith("DType")]
    return allowed


def read_shard(path: Path) -> dict[str, Any]:
    """One `model_optim_rng.pt`, unpickled by torch's weights-only unpickler with `_allowed`
    added, its tensors memory-mapped. A pickle that names another class is refused."""
    torch = _torch()
    try:
        with torch.serialization.safe_globals(_allowed()):
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:
                if "mmap" not in str(e):
                    raise
                # a legacy (non-zip) torch file cannot be memory-mapped: read it whole
                return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        try:
            names = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
        except Exception:  # an unreadable file: torch's message says what it met
            names = []
        known = {f"{o.__module__}.{o.__qualname__}" if not isinstance(o, tuple) else o[1]
                 for o in _allowed()}
        names = [n for n in names if n not in known] or [str(e).splitlines()[0]]
        raise ModelLoadError(
            f"{path} asks the unpickler for {', '.join(names)}, which a Megatron checkpoint "
            f"does not hold: refused, and nothing from the file ran. ee-jax builds only "
            f"tensors, argparse.Namespace, Megatron's ModelType and numpy arrays from it.") from e
    except (OSError, RuntimeError, ValueError, EOFError) as e:
        raise ModelLoadError(f"{path} is not a readable torch checkpoint: {e}") from e


# ------------------------------------------------------------------------------ the folder


def is_megatron(path: str | Path) -> bool:
    """A Megatron checkpoint folder: the tracker file, or an iteration folder of ranks."""
    path = Path(path)
    return path.is_dir() and ((path / TRACKER).is_file()
                              or any(_RANK_DIR.match(p.name) for p in path.iterdir()))


def iteration_dir(folder: Path) -> Path:
    """The folder of the iteration the tracker names (or `folder` itself if it holds ranks)."""
    if any(_RANK_DIR.match(p.name) for p in folder.iterdir()):
        return folder
    tracker = folder / TRACKER
    text = tracker.read_text().strip()
    if text == "release":
        it = folder / "release"
    elif text.isdigit():
        it = folder / f"iter_{int(text):07d}"
    else:
        raise ModelLoadError(f"{tracker} should hold an iteration number or 'release', "
                             f"not {text[:40]!r}")
    if not it.is_dir():
        raise ModelLoadError(f"{tracker} names iteration {text}, but {it} does not exist: "
                             f"the checkpoint is incomplete (copy that folder too)")
    return it


def shard_paths(it: Path, tp: int, pp: int) -> list[list[Path]]:
    """[stage][rank] -> its `model_optim_rng.pt`; a missing one is named."""
    out = []
    for stage in range(pp):
        row = []
        for rank in range(tp):
            name = f"mp_rank_{rank:02d}" + (f"_{stage:03d}" if pp > 1 else "")
            path = it / name / WEIGHTS
            if not path.is_file():
                raise ModelLoadError(
                    f"{path} is missing: the checkpoint was saved with tensor parallel {tp} "
                    f"and pipeline parallel {pp}, so it needs every mp_rank_XX"
                    f"{'_YYY' if pp > 1 else ''} folder")
            row.append(path)
        out.append(row)
    return out


# ------------------------------------------------------------------------------- the args

# Megatron options ee-jax implements only at one value: (option, the value, what it means).
_FIXED = (
    ("position_embedding_type", "rope", "rotary position embeddings"),
    ("normalization", "RMSNorm", "RMSNorm"),
    ("swiglu", True, "a SwiGLU MLP"),
    ("add_bias_linear", False, "bias-free projections"),
    ("apply_residual_connection_post_layernorm", False, "pre-norm residuals"),
    ("rotary_percent", 1.0, "RoPE over the whole head"),
    ("use_exit_block", False, "exits without an extra transformer block"),
    ("num_experts", None, "a dense MLP"),
    ("virtual_pipeline_model_parallel_size", None, "one model chunk a stage"),
)


def check_args(args: argparse.Namespace, source: str) -> None:
    """Refuse, naming the option, a checkpoint whose settings ee-jax does not implement."""
    for option, want, what in _FIXED:
        got = getattr(args, option, want)
        if option == "position_embedding_type" and got is None:
            got = "rope" if getattr(args, "use_rotary_position_embeddings", False) else got
        if got != want:
            hint = (" (exit blocks: an extra transformer layer per exit with its own K/V; "
                    "not served yet; convert the exits without it)"
                    if option == "use_exit_block" else "")
            raise UnsupportedModelError(
                f"{source}: args.{option} = {got!r}, but ee-jax serves {what} only "
                f"({option} = {want!r}){hint}")


def config_from_args(args: argparse.Namespace, *, dtype: str, name: str,
                     rope_theta: float | None = None) -> ModelConfig:
    """The backbone's `ModelConfig`. RoPE's base is not in EE-LLM's args (10000, Llama 2's);
    `rope_theta` overrides it for a backbone trained with another."""
    try:
        d, heads = int(args.hidden_size), int(args.num_attention_heads)
        layers = int(args.num_layers)
        ffn, vocab = int(args.ffn_hidden_size), int(args.padded_vocab_size)
    except (AttributeError, TypeError) as e:
        raise ModelLoadError(f"{name}: the checkpoint's args lack {e}") from e
    kv = int(args.num_query_groups) if getattr(args, "group_query_attention", False) else heads
    theta = rope_theta or float(getattr(args, "rotary_base", None) or 10000.0)
    try:
        return ModelConfig(
            vocab_size=vocab, d_model=d, n_layers=layers, n_heads=heads, n_kv_heads=kv,
            head_dim=int(getattr(args, "kv_channels", None) or d // heads), ffn_dim=ffn,
            rms_eps=float(getattr(args, "norm_epsilon", 1e-5)), rope_theta=theta,
            tie_embeddings=not getattr(args, "untie_embeddings_and_output_weights", False),
            max_position=int(getattr(args, "max_position_embeddings", None) or 4096),
            dtype=dtype, name=name)
    except ConfigError as e:
        raise ModelLoadError(f"{name}: the checkpoint's args describe no valid model: {e}") from e


def exits_from_args(args: argparse.Namespace, n_layers: int) -> tuple[list[tuple[int, int]],
                                                                       list[str]]:
    """[(Megatron layer number, ee-jax exit layer)] of the exits ee-jax serves, in order, and
    a note for each exit it cannot place."""
    pre = bool(getattr(args, "pre_exit", False))
    kept, notes = [], []
    for n in sorted(int(x) for x in (getattr(args, "exit_layer_nums", None) or [])):
        e = n - 1 if pre else n
        if 1 <= e < n_layers:
            kept.append((n, e))
        else:
            notes.append(f"the exit at layer {n} ({'pre' if pre else 'post'}) reads "
                         f"{'the embedding' if e < 1 else 'the last layer'}: ee-jax's exits "
                         f"lie between layers, so it is not served")
    return kept, notes


# ------------------------------------------------------------------------- merging shards


def _lm(shard: dict, path: Path) -> dict:
    try:
        model = shard["model"]
    except (KeyError, TypeError):
        raise ModelLoadError(f"{path} holds no 'model' entry: not a Megatron model "
                             f"checkpoint (its keys: {list(shard)[:8]})") from None
    if "language_model" not in model:
        raise ModelLoadError(f"{path}: model has no 'language_model' (keys: {list(model)[:8]}):"
                             f" not a GPT checkpoint")
    return model["language_model"]


def _encoder(lm: dict) -> dict:
    return lm.get("encoder", lm.get("transformer", {}))


def _np(t) -> np.ndarray:
    """The tensor as a numpy array without a copy (a view of the memory-mapped file); bf16
    through ml_dtypes, which numpy lacks."""
    t = t.detach()
    if t.dtype == _torch().bfloat16:
        return t.view(_torch().int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


class _Stage:
    """One pipeline stage's tensor-parallel ranks: their tensors merged on request."""

    def __init__(self, shards: list[dict], paths: list[Path], offset: int):
        self.lms = [_lm(s, p) for s, p in zip(shards, paths, strict=True)]
        self.paths = paths
        self.offset = offset  # layers in the stages before
        keys = {_LAYER_KEY.match(k) for k in _encoder(self.lms[0])}
        self.n_layers = 1 + max((int(m.group(1)) for m in keys if m), default=-1)

    def _get(self, rank: int, where: tuple[str, ...]):
        node: Any = self.lms[rank]
        for k in where:
            if not isinstance(node, dict) or k not in node:
                raise ModelLoadError(f"{self.paths[rank]}: tensor {'.'.join(where)} is missing")
            node = node[k]
        return node

    def has(self, *where: str) -> bool:
        node: Any = self.lms[0]
        for k in where:
            if not isinstance(node, dict) or k not in node:
                return False
            node = node[k]
        return True

    def _checked(self, a: np.ndarray, where: tuple[str, ...], shape: tuple[int, ...]
                 ) -> np.ndarray:
        if a.shape != shape:
            raise ParamsMismatchError(
                f"{'.'.join(where)} in {self.paths[0].parent.parent} (ranks merged) has shape "
                f"{list(a.shape)}, the checkpoint's args imply {list(shape)}")
        return a

    def _ranks(self, where: tuple[str, ...], axis: int) -> np.ndarray:
        parts = [_np(self._get(r, where)) for r in range(len(self.lms))]
        if any(p.ndim != 2 for p in parts):
            raise ParamsMismatchError(f"{'.'.join(where)} in {self.paths[0].parent.parent} is "
                                      f"not a matrix: {[list(p.shape) for p in parts]}")
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=axis)

    def replicated(self, *where: str, shape: tuple[int, ...]) -> np.ndarray:
        return self._checked(_np(self._get(0, where)), where, shape)

    def rows(self, *where: str, shape: tuple[int, ...]) -> np.ndarray:
        """Split by rows over the ranks (vocabulary rows, whole KV groups)."""
        return self._checked(self._ranks(where, 0), where, shape)

    def cols(self, *where: str, shape: tuple[int, ...]) -> np.ndarray:
        """Split by input columns over the ranks."""
        return self._checked(self._ranks(where, 1), where, shape)

    def gate_up(self, *where: str, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """[gate_r; up_r] on each rank -> (gate, up), each of `shape`."""
        parts = [_np(self._get(r, where)) for r in range(len(self.lms))]
        gate = [p[:len(p) // 2] for p in parts]  # views of the mapped file
        up = [p[len(p) // 2:] for p in parts]
        merge = lambda xs: xs[0] if len(xs) == 1 else np.concatenate(xs)  # noqa: E731
        return self._checked(merge(gate), where, shape), self._checked(merge(up), where, shape)


def _layer(stages: list[_Stage], i: int) -> tuple[_Stage, str]:
    """(stage, key prefix in its encoder) of global layer i (0-based)."""
    for st in stages:
        if st.offset <= i < st.offset + st.n_layers:
            return st, f"layers.{i - st.offset}."
    raise ModelLoadError(f"no pipeline stage holds layer {i}: the stages hold "
                         f"{sum(s.n_layers for s in stages)} layers, args say more")


def _qkv(w: np.ndarray, cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Megatron's fused QKV rows [G * (q_per_group + 2) * hd, D] -> HF q, k, v rows."""
    G, hd = cfg.n_kv_heads, cfg.head_dim
    qpg = cfg.n_heads // G
    g = w.reshape(G, (qpg + 2) * hd, w.shape[-1])
    return (g[:, :qpg * hd].reshape(-1, w.shape[-1]),
            g[:, qpg * hd:(qpg + 1) * hd].reshape(-1, w.shape[-1]),
            g[:, (qpg + 1) * hd:].reshape(-1, w.shape[-1]))


def layer_tensors(stages: list[_Stage], i: int, cfg: ModelConfig, trunk: bool
                  ) -> dict[str, np.ndarray]:
    """Layer i's weights under ee-jax's names, shards merged, still in the file's [out, in]
    orientation and dtype (views of the mapped file where no merge copies; `_to_device`
    transposes the 2-D ones: `TRANSPOSED`). trunk: the layer's MLP is split into trunk and
    branch (an exit MLP): the backbone's is the trunk."""
    st, p = _layer(stages, i)
    enc = ("encoder",) if st.has("encoder") else ("transformer",)
    at = lambda name: (*enc, p + name)  # noqa: E731
    D, F, hd = cfg.d_model, cfg.ffn_dim, cfg.head_dim
    qkv = st.rows(*at("self_attention.query_key_value.weight"),
                  shape=((cfg.n_heads + 2 * cfg.n_kv_heads) * hd, D))
    q, k, v = _qkv(qkv, cfg)
    mlp = "mlp.trunk." if trunk else "mlp."
    gate, up = st.gate_up(*at(mlp + "dense_h_to_4h.weight"), shape=(F, D))
    return {"attn_norm": st.replicated(*at("input_norm.weight"), shape=(D,)),
            "wq": q, "wk": k, "wv": v,
            "wo": st.cols(*at("self_attention.dense.weight"), shape=(D, cfg.n_heads * hd)),
            "mlp_norm": st.replicated(*at("post_attention_norm.weight"), shape=(D,)),
            "w_gate": gate, "w_up": up,
            "w_down": st.cols(*at(mlp + "dense_4h_to_h.weight"), shape=(D, F))}


TRANSPOSED = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")  # [out, in] -> [in, out]


_BLOCK = 256  # rows a transposing copy moves at a time (both sides stay in cache)


def _fill(dst: np.ndarray, src: np.ndarray, transpose: bool) -> None:
    """dst[...] = src (.T), cast on the way, in blocks of rows: a whole-matrix strided
    transpose-and-cast ran at a fifth of the speed (16 x [8192, 2048] fp16 into f32 on this
    2-core AMD EPYC: 3.0 s against 0.54 s in blocks of 256 rows)."""
    if not transpose:
        dst[...] = src
        return
    for r in range(0, src.shape[0], _BLOCK):
        dst[:, r:r + _BLOCK] = src[r:r + _BLOCK].T


def _to_device(pieces: list[np.ndarray], transpose: bool, dtype, stack: bool = True
               ) -> jax.Array:
    """Pieces (the file's dtype and [out, in] orientation, views of the mapped file) laid out
    (transposed where `transpose`), cast to `dtype` and stacked on a new leading axis (or the
    one piece, stack=False) in one host array, copied to the device. The pieces are filled on
    every core (numpy releases the GIL while it copies)."""
    shape = pieces[0].shape[::-1] if transpose else pieces[0].shape
    host = _aligned_empty((len(pieces), *shape) if stack else shape, dtype)
    outs = list(host) if stack else [host]
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(lambda ab: _fill(ab[0], ab[1], transpose), zip(outs, pieces,
                                                                      strict=True)))
    # on CPU the device array is this buffer (no copy: it is aligned as XLA wants); it is
    # never written again
    return jax.device_put(host, may_alias=True)


def _aligned_empty(shape: tuple[int, ...], dtype, align: int = 64) -> np.ndarray:
    """np.empty, 64-byte aligned: XLA's CPU client aliases such a buffer instead of copying
    it (a 1B model: 4.2 GB of copies saved). Without numpy's transparent-huge-page advice:
    where the kernel compacts memory for huge pages on demand (THP defrag "madvise", this
    machine's), first touching a fresh GB took 5-7 s against 0.85 s in 4 KiB pages."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    set_hugepage = getattr(getattr(np, "_core", np.core).multiarray, "_set_madvise_hugepage",
                           None)
    before = set_hugepage(False) if set_hugepage else None
    try:
        buf = np.empty(n + align, np.uint8)
    finally:
        if set_hugepage:
            set_hugepage(before)
    off = -buf.ctypes.data % align
    return buf[off:off + n].view(dtype).reshape(shape)


# ------------------------------------------------------------------------------ the loader


def _log(msg: str, progress: bool) -> None:
    if progress:
        print(f"[ee-jax] {msg}", file=sys.stderr, flush=True)


def load_megatron(folder: str | Path, dtype: str = "float32", *, rope_theta: float | None = None,
                  progress: bool = True) -> tuple[ModelConfig, Params, ExitConfig | None,
                                                   ExitHeads | None]:
    """(config, params, ExitConfig, exit heads) of an EE-LLM / EE-Tuning checkpoint folder
    (any tensor and pipeline parallel layout; shards merged); ExitConfig and heads None when
    it has no exit ee-jax can serve. Weights go to `dtype` a layer at a time."""
    folder = Path(folder)
    if not is_megatron(folder):
        raise ModelLoadError(f"{folder} is not a Megatron checkpoint folder (no {TRACKER} "
                             f"and no mp_rank_XX folders)")
    it = iteration_dir(folder)
    ranks = sorted(p.name for p in it.iterdir() if _RANK_DIR.match(p.name))
    if not ranks:
        raise ModelLoadError(f"{it} holds no mp_rank_XX folders: the checkpoint is empty")
    t0 = time.perf_counter()
    first_path = it / ranks[0] / WEIGHTS  # rank 0 of stage 0: the args
    if not first_path.is_file():
        raise ModelLoadError(f"{first_path} is missing: the checkpoint is incomplete")
    first = read_shard(first_path)
    args = first.get("args") if isinstance(first, dict) else None
    if not isinstance(args, argparse.Namespace):
        raise ModelLoadError(f"{first_path} holds no Megatron args "
                             f"(argparse.Namespace under 'args'): not a Megatron checkpoint")
    source = str(folder)
    check_args(args, source)
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    cfg = config_from_args(args, dtype=dtype, name=folder.name, rope_theta=rope_theta)
    paths = shard_paths(it, tp, pp)
    _log(f"reading {folder} (Megatron, tensor parallel {tp}, pipeline parallel {pp}, "
         f"{cfg.n_layers} layers, iteration {getattr(args, 'iteration', '?')})", progress)
    stages, offset = [], 0
    for row in paths:
        shards = [first if p == first_path else read_shard(p) for p in row]
        stages.append(_Stage(shards, row, offset))
        offset += stages[-1].n_layers
    if offset != cfg.n_layers:
        raise ModelLoadError(f"{source}: the stages hold {offset} layers, args.num_layers says "
                             f"{cfg.n_layers}")
    exits, notes = exits_from_args(args, cfg.n_layers)
    for note in notes:
        _log(note, progress)
    pre = bool(getattr(args, "pre_exit", False))
    branch = bool(getattr(args, "use_exit_mlp", False)) and not pre
    all_nums = sorted(int(x) for x in getattr(args, "exit_layer_nums", None) or [])
    # every exit layer's MLP is split into trunk and branch under use_exit_mlp (a pre exit's
    # branch is never read: the exit reads the layer's input)
    trunk_layers = {n - 1 for n in all_nums} if getattr(args, "use_exit_mlp", False) else set()
    target = np.dtype(cfg.jnp_dtype)
    shapes = param_shapes(cfg)

    # Every layer's pieces (views of the mapped files where no merge copies), then each
    # stacked leaf to the device in the file's dtype and laid out there: the host holds one
    # leaf in the file's dtype at a time.
    layer_keys = list(shapes.layers.to_dict())  # the config's layer weights
    pieces: dict[str, list[np.ndarray]] = {k: [] for k in layer_keys}
    for i in range(cfg.n_layers):
        for k, a in layer_tensors(stages, i, cfg, i in trunk_layers).items():
            pieces[k].append(a)
    tree: dict[str, Any] = {"layers": {}}  # the nested-dict form, checked once below
    for j, k in enumerate(layer_keys):
        tree["layers"][k] = _to_device(pieces.pop(k), k in TRANSPOSED, target)
        if progress and (j + 1) % 3 == 0:
            _log(f"  {j + 1}/{len(layer_keys)} layer weights", progress)
    emb_stage, last = stages[0], stages[-1]
    V, D = cfg.vocab_size, cfg.d_model
    one = functools.partial(_to_device, dtype=target, stack=False)
    tree["embed"] = one([emb_stage.rows("embedding", "word_embeddings", "weight",
                                        shape=(V, D))], False)
    enc = ("encoder",) if last.has("encoder") else ("transformer",)
    tree["final_norm"] = one([last.replicated(*enc, "final_norm.weight", shape=(D,))], False)
    if not cfg.tie_embeddings:  # [V, D] in the file, input-major [D, V] here
        tree["lm_head"] = one([last.rows("output_layer", "weight", shape=(V, D))], True)
    params = check_params(cfg, tree, source=source)

    ec = heads = None
    if exits:
        temps = [float(t) for t in getattr(args, "exit_layer_temperature", None) or []]
        temps = ([temps[all_nums.index(n)] for n, _ in exits]
                 if len(temps) == len(all_nums) else [])
        ec = ExitConfig(exit_layers=tuple(e for _, e in exits),
                        head="branch" if branch else "norm",
                        exit_norm=bool(getattr(args, "use_exit_norm", False)),
                        exit_output=bool(getattr(args, "untie_exit_output_weights", False)),
                        temperatures=tuple(temps) if any(t != 1.0 for t in temps) else ())
        ec.validate_for(cfg)
        heads = _exit_heads(stages, exits, all_nums, ec, cfg, target)
    _log(f"read {folder.name}: {cfg.n_layers} layers, d={cfg.d_model}, vocab={cfg.vocab_size}"
         f", exits {list(ec.exit_layers) if ec else []}"
         f"{f' (head {ec.head}, own outputs {ec.exit_output}, norm {ec.exit_norm})' if ec else ''}"
         f" in {time.perf_counter() - t0:.1f}s", progress)
    return cfg, params, ec, heads


def _exit_heads(stages: list[_Stage], exits: list[tuple[int, int]], all_nums: list[int],
                ec: ExitConfig, cfg: ModelConfig, target) -> ExitHeads:
    """Each exit's parts from the stage holding its layer, stacked in exit order. all_nums:
    every exit's Megatron layer number (a stage numbers its exit outputs over all of its own,
    served or not)."""
    D, F, V = cfg.d_model, cfg.ffn_dim, cfg.vocab_size
    norms, branches, outputs = [], [], []
    for n, _ in exits:
        st, p = _layer(stages, n - 1)
        enc = ("encoder",) if st.has("encoder") else ("transformer",)
        if ec.exit_norm:
            norms.append(st.replicated(*enc, p + "exit_norm.weight", shape=(D,)))
        if ec.head == "branch":
            gate, up = st.gate_up(*enc, p + "mlp.branch.dense_h_to_4h.weight", shape=(F, D))
            down = st.cols(*enc, p + "mlp.branch.dense_4h_to_h.weight", shape=(D, F))
            norm = st.replicated(*enc, p + "post_attention_norm.weight", shape=(D,))
            branches.append({"norm": norm, "w_gate": gate, "w_up": up, "w_down": down})
        if ec.exit_output:
            # exit_output_layer.{j}: j counts the exits of the stage, in layer order
            local = [m for m in all_nums if st.offset < m <= st.offset + st.n_layers]
            j = local.index(n)
            outputs.append(st.rows("exit_output_layer", f"{j}.weight", shape=(V, D)))
    heads: dict[str, Any] = {}
    if norms:
        heads["norm"] = _to_device(norms, False, target)
    if branches:
        heads["branch"] = Branch(**{k: _to_device([b[k] for b in branches], k in TRANSPOSED,
                                                  target) for k in branches[0]})
    if outputs:  # output-major [V, D], as the tied head
        heads["output"] = _to_device(outputs, False, target)
    return ExitHeads(**heads)

