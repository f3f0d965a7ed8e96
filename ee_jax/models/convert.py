"""`ee-jax convert`: a checkpoint ee-jax reads through torch (EE-LLM's Megatron format) written
once as a folder it reads without: Hugging Face safetensors for the backbone, the exits as
exit heads beside it, the tokenizer copied in.

    <out>/config.json, model.safetensors   the backbone (Llama; transformers loads it too)
    <out>/exit_heads/                      the checkpoint's exits (`exit_checkpoint`)
    <out>/tokenizer.json, ...              the tokenizer given, with its chat template

`load_model(<out>)` then serves with those exits (`LoadedModel.shipped_exit_heads`), and
`ee-jax calibrate` can pick their threshold on the user's prompts.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

from ee_jax.errors import ModelLoadError
from ee_jax.models.exits.checkpoint import save_exit_heads
from ee_jax.models.formats import hf
from ee_jax.models.loading import EXIT_HEADS_DIR, load_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "generation_config.json", "special_tokens_map.json", "tokenizer.model")


def convert(src: str | Path, out: str | Path, *, dtype: str = "float32",
            tokenizer: str | Path | None = None, overwrite: bool = False,
            progress: bool = True) -> Path:
    """Write the model at `src` (any kind `load_model` reads; meant for Megatron checkpoints)
    to folder `out` (see the module docstring). dtype: of the written weights ("float32"
    keeps an fp16 backbone and fp32 exits exact; "bfloat16" halves the size)."""
    t0 = time.perf_counter()
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{out} exists and is not empty: pass overwrite=True "
                                  f"(--overwrite) to replace it, or another folder")
        shutil.rmtree(out)
    model = load_model(src, dtype=dtype, progress=progress, tokenizer=tokenizer)
    hf.save_hf(out, model.config, model.params)
    if model.exits is not None:
        ec, heads = model.exits
        save_exit_heads(out / EXIT_HEADS_DIR, model.config, ec, heads)
    if tokenizer is not None:
        tok = Path(tokenizer)
        folder = tok if tok.is_dir() else tok.parent
        files = [folder / n for n in TOKENIZER_FILES if (folder / n).is_file()]
        if not tok.is_dir() and tok.name != "tokenizer.json":
            raise ModelLoadError(f"--tokenizer {tok}: pass a tokenizer.json or its folder")
        for f in files:
            shutil.copy2(f, out / f.name)
    if progress:
        print(f"[ee-jax] wrote {out} ({model.config.n_layers} layers"
              f"{', exits ' + str(list(model.exits[0].exit_layers)) if model.exits else ''}"
              f"{', tokenizer' if tokenizer is not None else ', no tokenizer'}) in "
              f"{time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return out
