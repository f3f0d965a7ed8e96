"""How good and how fast the early exits are (`ee-jax eval`; docs/architecture.md section 7).

    compare      prefix agreement, match rate, ROUGE-L of a token sequence vs a reference
    calibration  reliability bins and expected calibration error
    layerwise    per exit layer on held-out text, from one dense pass: confidence, agreement
    simulate     teacher-forced batch-1 exits at thresholds, from those predictions
    nll          the full model's NLL of generated text
    sweep        end to end with the serving engine vs full depth
    prompts      HumanEval, held-out instructions and text
    report       eval.md and the plots
    evaluate     all of the above from EvalOptions
"""

from ee_jax.evaluation.calibration import Reliability, expected_calibration_error, reliability
from ee_jax.evaluation.compare import (
    common_prefix,
    lcs_length,
    match_rate,
    prefix_agreement,
    rouge_l,
)
from ee_jax.evaluation.evaluate import EvalOptions, evaluate
from ee_jax.evaluation.layerwise import ExitPredictions, LayerStats, exit_predictions
from ee_jax.evaluation.nll import FullModelNLL
from ee_jax.evaluation.report import EvalReport, write_report
from ee_jax.evaluation.simulate import SimulatedExits, simulate_exits
from ee_jax.evaluation.sweep import SweepResult, SweepRow, run_sweep

__all__ = [
    "EvalOptions", "EvalReport", "ExitPredictions", "FullModelNLL", "LayerStats", "Reliability",
    "SimulatedExits", "SweepResult", "SweepRow", "common_prefix", "evaluate",
    "exit_predictions", "expected_calibration_error", "lcs_length", "match_rate",
    "prefix_agreement", "reliability", "rouge_l", "run_sweep", "simulate_exits",
    "write_report",
]
