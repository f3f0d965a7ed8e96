"""The tuning configuration: everything a tuning run depends on, filled from a YAML preset.

Apart from the training code (`tune.py`) so that what only reads a preset (the `ee-jax
calibrate` command, benchmarks) needs none of it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from ee_jax.errors import EEJaxError
from ee_jax.models.exits import backfill_maps
from ee_jax.models.exits.config import ExitConfig, ExitConfigError, uses_maps
from ee_jax.settings import from_flat
from ee_jax.training.losses import LossWeights


class TuneConfigError(EEJaxError, ValueError):
    """A tuning configuration that cannot run."""


def _tuned_exits() -> ExitConfig:
    """What `ee-jax tune` trains where a preset does not say: exits every third layer of
    SmolLM2's upper 24, residual MLP heads (width 256), a linear confidence classifier."""
    return ExitConfig(exit_layers=(6, 9, 12, 15, 18, 21, 24, 27), head="mlp", adapter_rank=256,
                      measure="classifier", threshold=0.8)


@dataclasses.dataclass(frozen=True)
class TuneConfig:
    """Everything a tuning run depends on; a YAML preset fills it (`from_yaml`). The heads'
    own settings (exit layers, head, measure, default threshold, vocabulary subset, target
    agreement, back-fill) are an `ExitConfig`'s, `exit_config`; `TuneConfig.make` and
    presets take them flat beside the others too."""

    model: str = "smollm2-135m-instruct"  # the frozen backbone: a registry name or a path
    # the heads trained and saved with it (`threshold`: the one stored with them until
    # calibration picks one, `target_agreement`: what calibration certifies)
    exit_config: ExitConfig = dataclasses.field(default_factory=_tuned_exits)
    # data
    seq_len: int = 256  # tokens per training row (answers and source packed into rows)
    chat_instructions: int = 160  # train instructions the model answers itself
    code_prompts: int = 160  # stdlib function headers the model completes itself
    everyday_train: int = 0  # everyday chat requests ("train" split) the model answers itself
    gen_max_tokens: int = 96  # longest self-generated answer, tokens
    gen_batch: int = 32  # prompts a self-generation step answers at once
    stdlib_tokens: int = 40_000  # raw standard-library source, tokens
    eval_sequences: int = 8  # held-out stdlib sequences scored at the end
    # optimisation
    batch_size: int = 2  # rows per optimiser step
    epochs: int = 1  # passes over the training rows
    lr: float = 1e-3  # AdamW's peak learning rate (after warm-up, then cosine decay)
    warmup_steps: int = 10  # steps of linear warm-up from 0 to lr
    weight_decay: float = 0.01  # AdamW's decoupled weight decay
    grad_clip: float = 1.0  # global gradient norm clipped to this
    kl_weight: float = 1.0  # loss weight of KL(final layer || exit) per exit
    ce_weight: float = 0.1  # loss weight of cross-entropy on the real next token
    classifier_weight: float = 1.0  # loss weight of the confidence classifier's BCE
    remat: bool = False  # recompute each exit's logits in the backward pass (less memory)
    seed: int = 0  # heads' initialisation, data order and self-generation sampling
    # method "cached": the backbone runs once and the heads train on its cached exit states
    method: str = "full"  # "full" | "cached"
    kl_vocab: int = 4096  # restricted vocabulary per batch (real next tokens + teacher top-k)
    teacher_topk: int = 16  # "cached": the teacher's top ids per position in that vocabulary
    calib_instructions: int = 0  # held-apart ("calib" split) instructions the model answers
    calib_code_prompts: int = 0  # held-apart function headers the model completes
    calib_everyday: int = 0  # held-apart everyday chat requests (`data.everyday_requests`)
    calib_delta: float = 0.1  # the guarantee holds with probability >= 1 - calib_delta
    # learned back-fill maps (`backfill_maps`), fitted after the heads on the training rows'
    # dense states and shipped beside them (method "cached"); rank 0: none
    backfill_rank: int = backfill_maps.DEFAULT_RANK
    backfill_ridge: float = 1e-3  # the maps' ridge penalty (least squares, per layer)
    backfill_tokens: int = 65536  # training tokens the maps are fitted on
    decision_tokens: int = 32768  # training tokens the decision MLPs are fitted on
    decision_steps: int = 400  # optimiser steps of the decision MLPs' fit
    # output
    work_dir: str = "runs/tune-smollm2-135m"  # data cache, loss log, checkpoints (resumed)
    output: str = "runs/tune-smollm2-135m/exit_heads"  # the trained heads' folder
    checkpoint_every: int = 20  # optimiser steps between checkpoints in work_dir
    max_steps: int | None = None  # cap (tests, smoke runs)

    def __post_init__(self):
        for name in ("seq_len", "batch_size", "epochs", "gen_batch"):
            if getattr(self, name) <= 0:
                raise TuneConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.lr <= 0:
            raise TuneConfigError(f"lr must be positive, got {self.lr}")
        ec = self.exit_config
        if ec.adapter_rank <= 0:
            raise TuneConfigError(f"adapter_rank must be positive, got {ec.adapter_rank}")
        if self.method not in ("full", "cached"):
            raise TuneConfigError(f"method must be 'full' or 'cached', got {self.method!r}")
        if self.method == "cached" and ec.measure == "classifier":
            raise TuneConfigError("method 'cached' trains decision MLPs (measure "
                                  "'candidates') or none (a vocabulary measure); the "
                                  "classifier needs method 'full'")
        if self.method == "full" and (ec.vocab_subset or ec.measure == "candidates"):
            raise TuneConfigError("vocab_subset and measure 'candidates' need method 'cached'")
        if self.backfill_rank < 0 or self.backfill_tokens <= 0 or self.backfill_ridge < 0:
            raise TuneConfigError(f"backfill_rank must be >= 0, backfill_tokens > 0 and "
                                  f"backfill_ridge >= 0, got {self.backfill_rank}, "
                                  f"{self.backfill_tokens}, {self.backfill_ridge}")
        if uses_maps(ec.backfill) and not self.backfill_rank:
            raise TuneConfigError("backfill 'learned' needs fitted maps: set backfill_rank > 0")

    @classmethod
    def make(cls, **settings) -> TuneConfig:
        """A TuneConfig from flat settings, each a field of TuneConfig or of ExitConfig (over
        the default `exit_config`; `settings.from_flat`): `TuneConfig.make(exit_layers=(4, 8),
        epochs=2)`. ExitConfig's errors come as TuneConfigError."""
        try:
            return from_flat(cls, "exit_config", settings)
        except (TypeError, ExitConfigError) as e:
            raise TuneConfigError(str(e)) from e

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides) -> TuneConfig:
        """The preset at `path` (a mapping of `make`'s settings; the exit settings flat or
        under `exit_config:`), with `overrides` that are not None on top."""
        import yaml

        path = Path(path)
        if not path.is_file():
            raise TuneConfigError(f"tuning config not found: {path}")
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        if not isinstance(raw, dict):
            raise TuneConfigError(f"{path}: expected a mapping of settings")
        raw.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls.make(**raw)
        except TuneConfigError as e:
            raise TuneConfigError(f"{path}: {e}") from e

    def loss_weights(self) -> LossWeights:
        return LossWeights(self.kl_weight, self.ce_weight, self.classifier_weight)

    def data_key(self) -> str:
        keys = ("model", "seq_len", "chat_instructions", "code_prompts", "gen_max_tokens",
                "stdlib_tokens", "eval_sequences", "seed", "calib_instructions",
                "calib_code_prompts")
        d = {k: getattr(self, k) for k in keys}
        # absent when 0, so that older presets keep their cached data
        d.update({k: getattr(self, k) for k in ("calib_everyday", "everyday_train")
                  if getattr(self, k)})
        blob = json.dumps(d, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]
