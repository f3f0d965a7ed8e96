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
from ee_jax.models import backfill_maps
from ee_jax.models.exit_config import BACKFILLS, ExitConfig, uses_maps
from ee_jax.training.losses import LossWeights


class TuneConfigError(EEJaxError, ValueError):
    """A tuning configuration that cannot run."""


@dataclasses.dataclass(frozen=True)
class TuneConfig:
    """Everything a tuning run depends on; a YAML preset fills it (`from_yaml`)."""

    model: str = "smollm2-135m-instruct"
    # heads
    exit_layers: tuple[int, ...] = (6, 9, 12, 15, 18, 21, 24, 27)
    head: str = "mlp"
    adapter_rank: int = 256
    measure: str = "classifier"
    threshold: float = 0.8  # default threshold stored with the heads
    min_exit_layer: int = 1
    # data
    seq_len: int = 256
    chat_instructions: int = 160  # train instructions the model answers itself
    code_prompts: int = 160  # stdlib function headers the model completes itself
    everyday_train: int = 0  # everyday chat requests ("train" split) the model answers itself
    gen_max_tokens: int = 96
    gen_batch: int = 32
    stdlib_tokens: int = 40_000  # raw standard-library source, tokens
    eval_sequences: int = 8  # held-out stdlib sequences scored at the end
    # optimisation
    batch_size: int = 2
    epochs: int = 1
    lr: float = 1e-3
    warmup_steps: int = 10
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    kl_weight: float = 1.0
    ce_weight: float = 0.1
    classifier_weight: float = 1.0
    remat: bool = False  # recompute each exit's logits in the backward pass (less memory)
    seed: int = 0
    # method "cached": the backbone runs once and the heads train on its cached exit states
    method: str = "full"  # "full" | "cached"
    vocab_subset: int = 0  # K: exit heads score the K most frequent ids (0: all)
    candidates: int = 8  # measure "candidates": tokens later checks score
    kl_vocab: int = 4096  # restricted vocabulary per batch (real next tokens + teacher top-k)
    teacher_topk: int = 16
    calib_instructions: int = 0  # held-apart ("calib" split) instructions the model answers
    calib_code_prompts: int = 0
    calib_everyday: int = 0  # held-apart everyday chat requests (`data.everyday_requests`)
    target_agreement: float = 0.95
    calib_delta: float = 0.1  # the guarantee holds with probability >= 1 - calib_delta
    backfill: str = "deferred"  # the back-fill the heads are served (and calibrated) with
    # learned back-fill maps (`backfill_maps`), fitted after the heads on the training rows'
    # dense states and shipped beside them (method "cached"); rank 0: none
    backfill_rank: int = backfill_maps.DEFAULT_RANK
    backfill_ridge: float = 1e-3
    backfill_tokens: int = 65536  # training tokens the maps are fitted on
    decision_tokens: int = 32768  # training tokens the decision MLPs are fitted on
    decision_steps: int = 400
    # output
    work_dir: str = "runs/tune-smollm2-135m"
    output: str = "runs/tune-smollm2-135m/exit_heads"
    checkpoint_every: int = 20
    max_steps: int | None = None  # cap (tests, smoke runs)

    def __post_init__(self):
        object.__setattr__(self, "exit_layers", tuple(int(e) for e in self.exit_layers))
        for name in ("seq_len", "batch_size", "epochs", "gen_batch", "adapter_rank"):
            if getattr(self, name) <= 0:
                raise TuneConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.lr <= 0:
            raise TuneConfigError(f"lr must be positive, got {self.lr}")
        if self.method not in ("full", "cached"):
            raise TuneConfigError(f"method must be 'full' or 'cached', got {self.method!r}")
        if self.method == "cached" and self.measure == "classifier":
            raise TuneConfigError("method 'cached' trains decision MLPs (measure "
                                  "'candidates') or none (a vocabulary measure); the "
                                  "classifier needs method 'full'")
        if self.method == "full" and (self.vocab_subset or self.measure == "candidates"):
            raise TuneConfigError("vocab_subset and measure 'candidates' need method 'cached'")
        if not 0.0 < self.target_agreement <= 1.0:
            raise TuneConfigError(f"target_agreement must be in (0, 1], got "
                                  f"{self.target_agreement}")
        if self.backfill_rank < 0 or self.backfill_tokens <= 0 or self.backfill_ridge < 0:
            raise TuneConfigError(f"backfill_rank must be >= 0, backfill_tokens > 0 and "
                                  f"backfill_ridge >= 0, got {self.backfill_rank}, "
                                  f"{self.backfill_tokens}, {self.backfill_ridge}")
        if uses_maps(self.backfill) and not self.backfill_rank:
            raise TuneConfigError("backfill 'learned' needs fitted maps: set backfill_rank > 0")
        if self.backfill not in BACKFILLS:
            raise TuneConfigError(f"backfill must be one of {BACKFILLS}, got "
                            f"{self.backfill!r}")

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides) -> TuneConfig:
        import yaml

        path = Path(path)
        if not path.is_file():
            raise TuneConfigError(f"tuning config not found: {path}")
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        if not isinstance(raw, dict):
            raise TuneConfigError(f"{path}: expected a mapping of settings")
        raw.update({k: v for k, v in overrides.items() if v is not None})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise TuneConfigError(f"{path}: unknown settings {unknown}; known: {sorted(known)}")
        return cls(**raw)

    def exit_config(self) -> ExitConfig:
        return ExitConfig(exit_layers=self.exit_layers, head=self.head,
                          measure=self.measure, threshold=self.threshold,
                          min_exit_layer=self.min_exit_layer,
                          adapter_rank=self.adapter_rank, vocab_subset=self.vocab_subset,
                          candidates=self.candidates,
                          target_agreement=self.target_agreement,
                          backfill=self.backfill)

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
