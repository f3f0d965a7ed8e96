"""One call from a model name or path to config + params + tokenizer."""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

from ee_jax.models import registry
from ee_jax.models.config import ModelConfig
from ee_jax.models.tokenizer import Tokenizer


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    params: Any
    tokenizer: Tokenizer | None
    source: str
    name: str | None = None  # the registry name, when loaded by one

    def shipped_exit_heads(self):
        """(ExitConfig, heads) shipped for this model, or None (see registry)."""
        from ee_jax.models.exit_checkpoint import load_exit_heads

        path = registry.shipped_exit_heads(self.name) if self.name else None
        return None if path is None else load_exit_heads(path, self.config)


def load_model(name_or_path: str | Path, dtype: str = "float32", *,
               progress: bool = True) -> LoadedModel:
    """A registry name (`smollm2-135m-instruct`), a .gguf file, a Hugging Face folder
    (config.json + safetensors) or an ee-jax orbax checkpoint folder."""
    t0 = time.perf_counter()
    kind, path = registry.resolve_model(name_or_path)
    if progress:
        print(f"[ee-jax] loading {name_or_path} ({kind}: {path})", file=sys.stderr)
    cfg, params = registry.load_params(name_or_path, dtype=dtype)
    tokenizer = None
    if kind == "gguf":
        # The model's own tokenization (SmolLM2's tokenizer.json splits digits; transformers'
        # GGUF conversion does not): see ee_jax.models.tokenizer.
        tokenizer = Tokenizer.from_gguf(path, compat="llama.cpp")
    elif (Path(path) / "tokenizer.json").exists():
        tokenizer = Tokenizer.from_file(path)
    if progress:
        print(f"[ee-jax] loaded {cfg.n_layers} layers, d={cfg.d_model}, "
              f"vocab={cfg.vocab_size}, {dtype} in {time.perf_counter() - t0:.1f}s",
              file=sys.stderr)
    name = str(name_or_path) if str(name_or_path) in registry.MODELS else None
    return LoadedModel(cfg, params, tokenizer, str(path), name)
