"""Calibration of shipped exit heads on the served engine: the served tables' calibration.json,
and shipping a pick into a heads folder. The statistics (Learn-then-Test, the tables, the
threshold a table certifies) are `ee_jax.models.exits.threshold`; the `ee-jax calibrate`
command drives both.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from ee_jax.models.exits.checkpoint import CALIBRATION, CONFIG
from ee_jax.models.exits.config import BACKFILLS, ExitConfigError
from ee_jax.models.exits.threshold import (
    DEFAULT_DELTA,
    CalibrationTable,
    check_target,
    pick_threshold,
    pick_threshold_groups,
    threshold_from_json,
)

SERVED_RULE = ("served: per group (instructions, code, everyday chat), Learn-then-Test on "
               "the engine's own errors with each calibration answer's full-depth tokens "
               "forced (back-filled K/V included; binomial and cluster-robust tests, the "
               "larger p-value); the threshold is the highest of the groups' picks")


def served_calibration(tables: Mapping[str, CalibrationTable], target_agreement: float,
                       delta: float = DEFAULT_DELTA, command: str | None = None,
                       backfill: str | None = None) -> dict:
    """A calibration.json for served tables (`tune.served_tables`): the rule, the target, the
    per-group picks and the tables, read back by `threshold_from_json` like the dense ones
    (the threshold is the groups' highest, `pick_threshold_groups`). backfill: the
    `ExitConfig.backfill` the tables were served with (served agreement depends on it, so
    shipping the pick ships it too)."""
    check_target(target_agreement, delta)
    if backfill is not None and backfill not in BACKFILLS:
        raise ExitConfigError(f"unknown backfill {backfill!r}; choose one of "
                                    f"{BACKFILLS}")
    picks = {g: pick_threshold(t, target_agreement, delta) for g, t in tables.items()}
    res = {"rule": SERVED_RULE, "measure": "served", "target_agreement": target_agreement,
           "delta": delta, "confidence": 1.0 - delta,
           "threshold": pick_threshold_groups(tables, target_agreement, delta),
           "picks": picks, "groups": {g: t.to_json() for g, t in tables.items()}}
    if command is not None:
        res["command"] = command
    if backfill is not None:
        res["backfill"] = backfill
    return res


def ship_calibration(heads_dir, cal: dict) -> None:
    """Make `cal` the shipped calibration of the heads in `heads_dir`: calibration.json
    becomes `cal` (the tables it replaces kept under "previous" when they were dense), and
    exit_config.json's threshold and target agreement (and back-fill, when `cal` records the
    one its tables were served with) become `cal`'s, so `load_exit_heads` serves them by
    default. The heads' arrays are not touched."""
    heads_dir = Path(heads_dir)
    if not (heads_dir / CONFIG).is_file():
        raise ExitConfigError(f"{heads_dir} holds no exit heads ({CONFIG} missing)")
    if threshold_from_json(cal, cal["target_agreement"]) != cal["threshold"]:
        raise ValueError(f"calibration threshold {cal['threshold']} is not what its tables "
                         f"certify for target {cal['target_agreement']}")
    out = dict(cal)
    old_path = heads_dir / CALIBRATION
    if old_path.is_file():
        old = json.loads(old_path.read_text())  # the dense tables stay, for reference
        prev = ({"measure": "dense", **old} if old.get("measure", "dense") == "dense"
                else old.get("previous"))
        if prev:
            out["previous"] = prev
    old_path.write_text(json.dumps(out, indent=1) + "\n")
    meta = json.loads((heads_dir / CONFIG).read_text())
    meta["exit_config"]["threshold"] = cal["threshold"]
    meta["exit_config"]["target_agreement"] = cal["target_agreement"]
    if "backfill" in cal:
        meta["exit_config"]["backfill"] = cal["backfill"]
    (heads_dir / CONFIG).write_text(json.dumps(meta, indent=2) + "\n")
