"""One call from a model name or path to config + params + tokenizer."""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax

from ee_jax.models import quant, registry
from ee_jax.models.config import ModelConfig
from ee_jax.models.exits.checkpoint import load_exit_heads, load_exit_prior
from ee_jax.models.exits.config import ExitConfig
from ee_jax.models.formats import gguf
from ee_jax.models.formats.hf import Placer
from ee_jax.models.formats.megatron import load_megatron
from ee_jax.models.params import Params, as_params
from ee_jax.models.tokenizer import Tokenizer

EXIT_HEADS_DIR = "exit_heads"  # a model folder's own exit heads (`ee-jax convert` writes it)


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    params: Params  # a mapping of weight keys given here is converted (`as_params`)
    tokenizer: Tokenizer | None
    source: str
    name: str | None = None  # the registry name, when loaded by one
    exits: tuple[ExitConfig, dict] | None = None  # the checkpoint's own (EE-LLM's)

    def __post_init__(self):
        self.params = as_params(self.params)

    def _heads_dir(self) -> Path | None:
        if self.name:
            return registry.shipped_exit_heads(self.name)
        own = Path(self.source) / EXIT_HEADS_DIR
        return own if (own / "exit_config.json").is_file() else None

    def shipped_exit_heads(self):
        """(ExitConfig, heads) that come with this model, or None: the checkpoint's own exits
        (EE-LLM), the `exit_heads/` folder beside its weights, or the heads the registry
        ships for it."""
        if self.exits is not None:
            return self.exits
        path = self._heads_dir()
        return None if path is None else load_exit_heads(path, self.config)

    def shipped_exit_prior(self, ec) -> tuple[tuple[int, float], ...]:
        """The exit layers the shipped heads are expected to give under `ec`
        (`exit_checkpoint.load_exit_prior`), () where none are known."""
        path = None if self.exits is not None else self._heads_dir()
        return () if path is None else load_exit_prior(path, self.config, ec)


def load_model(name_or_path: str | Path, dtype: str = "float32", *,
               quantize: str | None = None, progress: bool = True,
               placement: Callable[[ModelConfig], Placer] | None = None,
               blocks: bool = True, tokenizer: str | Path | None = None) -> LoadedModel:
    """A registry name (`smollm2-135m-instruct`), a .gguf file, a Hugging Face folder
    (config.json + safetensors), an ee-jax orbax checkpoint folder, or a Megatron checkpoint
    of an EE-LLM model (its exits come with it: `LoadedModel.exits`).

    quantize="int8": the layer weights become int8 with per-output-channel scales once
    loaded (`ee_jax.models.quant`); the embedding, LM head and norms stay in `dtype`.
    placement: cfg -> where each parameter leaf goes (`ee_jax.serving.sharding.placement`,
    built by the caller from its mesh): a Hugging Face folder's weights go straight to their
    shards as they are read (other formats, and int8 `quantize`, are sharded by the engine
    after loading).
    blocks (GGUF, the default): layer weights stored as Q4_0/Q4_1/Q8_0 stay in the file's
    blocks (`quant.BlockQ`): bit-identical weights at the file's own size (Q4 one value a
    byte on CPU, `quant.for_platform`), dequantized inside each step, so decoding reads less
    memory; under a mesh the engine shards the blocks as it shards the weights they stand
    for. blocks=False or an int8 `quantize`: every weight dequantized to `dtype` on the host.
    tokenizer: a tokenizer.json (or a folder holding one, its chat template beside it) to use
    instead of the model's own; a Megatron checkpoint holds none, so it needs one to serve
    text."""
    quant.check_quantize(quantize)  # before minutes of loading
    t0 = time.perf_counter()
    kind, path = registry.resolve_model(name_or_path)
    if progress:
        print(f"[ee-jax] loading {name_or_path} ({kind}: {path})", file=sys.stderr)
    exits = None
    if kind == "megatron":
        cfg, params, ec, heads = load_megatron(path, dtype=dtype, progress=progress)
        exits = None if ec is None else (ec, heads)
    else:
        cfg, params = registry.load_params(name_or_path, dtype=dtype,
                                           placement=None if quantize else placement,
                                           blocks=blocks and quantize in (None, "int4"))
    if quant.check_quantize(quantize) is not None:  # a leaf at a time: the loader's own tree
        tree, params = params.to_dict(), None
        quant.quantize_layers(tree["layers"], quantize, block_quantize=gguf.block_quantize)
        params = as_params(tree)
    # block weights as this machine's steps read them best (CPU: one value a byte)
    params = quant.for_platform(params, jax.default_backend())
    given, tokenizer = tokenizer, None
    if given is not None:
        tokenizer = Tokenizer.from_file(given)
    elif kind == "gguf":
        # The model's own tokenization (SmolLM2's tokenizer.json splits digits; transformers'
        # GGUF conversion does not): see ee_jax.models.tokenizer.
        tokenizer = Tokenizer.from_gguf(path, compat="llama.cpp")
    elif (Path(path) / "tokenizer.json").exists():
        tokenizer = Tokenizer.from_file(path)
    if progress:
        print(f"[ee-jax] loaded {cfg.n_layers} layers, d={cfg.d_model}, "
              f"vocab={cfg.vocab_size}, {dtype}{' + int8 layer weights' if quantize else ''}"
              f"{' (layer weights in their GGUF blocks)' if quant.has_blocks(params) else ''}"
              f" ({quant.param_bytes(params) / 2**20:.0f} MiB) in "
              f"{time.perf_counter() - t0:.1f}s",
              file=sys.stderr)
    if tokenizer is None and kind == "megatron" and progress:
        print("[ee-jax] a Megatron checkpoint holds no tokenizer: pass one (--tokenizer "
              "<tokenizer.json or folder>) to serve text; token ids work without",
              file=sys.stderr)
    name = str(name_or_path) if str(name_or_path) in registry.MODELS else None
    return LoadedModel(cfg, params, tokenizer, str(path), name, exits)


def quantize_model(model: LoadedModel, quantize: str | None) -> LoadedModel:
    """`model` with its layer weights quantized (`quant.quantize_params`); itself when
    quantize is None."""
    if quant.check_quantize(quantize) is None:
        return model
    params = quant.for_platform(quant.quantize_params(model.params, quantize,
                                                      block_quantize=gguf.block_quantize),
                                jax.default_backend())
    return dataclasses.replace(model, params=params)
