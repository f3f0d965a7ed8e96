"""Each config field is defined once, documented where it is declared, and what restates it
(the CLI's flags, whose parser may not import JAX) agrees with it. Read statically with `ast`
where it can be (the documentation rule) and from the classes themselves (the defaults)."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import re
from pathlib import Path

import pytest

from ee_jax import cli, settings
from ee_jax.evaluation.evaluate import EvalOptions
from ee_jax.models import llama
from ee_jax.models.exits.config import SERVING_POLICY, ExitConfig
from ee_jax.serving import attention_kernels, controller
from ee_jax.serving.aot import compile as aot
from ee_jax.serving.controller import ControllerConfig
from ee_jax.serving.plan import EngineConfig
from ee_jax.serving.scheduler import SchedulerConfig
from ee_jax.serving.server import ServerConfig
from ee_jax.training.tune_config import TuneConfig, TuneConfigError

ROOT = Path(__file__).resolve().parent.parent / "ee_jax"


def _config_fields():
    """(file, class, field, documented) of every field of every dataclass under ee_jax whose
    name ends in "Config". The rule: a field is documented by a comment on its own line(s),
    a comment line right above it (the end of a comment block), or a line of the class
    docstring that starts with its name ("threshold: a row is confident ...")."""
    for path in sorted(ROOT.rglob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not (isinstance(node, ast.ClassDef) and node.name.endswith("Config")):
                continue
            if not any("dataclass" in ast.unparse(d) for d in node.decorator_list):
                continue
            doc = ast.get_docstring(node) or ""
            named = set(re.findall(r"^\s*(\w+)", doc, re.M))
            for item in node.body:
                if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                    continue
                own = lines[item.lineno - 1:item.end_lineno]
                above = lines[item.lineno - 2].strip()
                documented = (any("#" in line for line in own) or above.startswith("#")
                              or item.target.id in named)
                yield path.relative_to(ROOT.parent), node.name, item.target.id, documented


def test_every_config_field_is_documented_where_it_is_declared():
    fields = list(_config_fields())
    assert len(fields) > 100  # the walk found the configs
    bare = [f"{path}: {cls}.{name}" for path, cls, name, ok in fields if not ok]
    assert not bare, "config fields without a doc line (a comment on or above the field, or " \
        "a docstring line starting with its name):\n" + "\n".join(bare)


@pytest.mark.parametrize("outer,inner", [(EngineConfig, "scheduler"),
                                         (TuneConfig, "exit_config")])
def test_nested_configs_share_no_field_name(outer, inner):
    """A flat setting (`EngineConfig.make`, `TuneConfig.make`) names one field of one class."""
    nested = type(settings.nested_default(outer, inner))
    assert not set(settings.field_names(outer)) & set(settings.field_names(nested))


def test_tune_config_takes_the_heads_settings_flat_or_nested(tmp_path):
    flat = TuneConfig.make(exit_layers=(2, 4), head="norm", epochs=3)
    assert flat.exit_config == dataclasses.replace(TuneConfig().exit_config, exit_layers=(2, 4),
                                                   head="norm")
    assert flat.epochs == 3
    p = tmp_path / "t.yaml"
    p.write_text("epochs: 3\nexit_config:\n  exit_layers: [2, 4]\n  head: norm\n")
    assert TuneConfig.from_yaml(p) == flat
    p.write_text("epochs: 3\nexit_layers: [2, 4]\nhead: norm\n")  # flat, as older presets
    assert TuneConfig.from_yaml(p) == flat
    with pytest.raises(TuneConfigError, match="strictly increasing"):  # ExitConfig's check
        TuneConfig.make(exit_layers=(4, 2))


def _subcommand(name: str) -> dict[str, argparse.Action]:
    sub = next(a for a in cli.build_parser()._actions
               if isinstance(a, argparse._SubParsersAction)).choices[name]
    return {a.dest: a for a in sub._actions}


# flag dest -> the dataclass field it sets
ENGINE_FLAGS = {
    "max_num_seqs": (SchedulerConfig, "max_num_seqs"),
    "max_model_len": (SchedulerConfig, "max_model_len"),
    "page_size": (SchedulerConfig, "page_size"),
    "mixed_steps": (SchedulerConfig, "mixed_steps"),
    "num_pages": (EngineConfig, "num_pages"),
    "mesh": (EngineConfig, "mesh"),
    "attention": (EngineConfig, "attention"),
    "async_scheduling": (EngineConfig, "async_scheduling"),
    "exit_control": (ControllerConfig, "mode"),
}
SERVER_FLAGS = {k: (ServerConfig, k) for k in
                ("host", "port", "max_body_bytes", "max_prompt_tokens", "log_level",
                 "startup_wait", "keep_alive")}
EVAL_FLAGS = {k: (EvalOptions, k) for k in
              ("model", "dtype", "exit_heads", "limit", "max_tokens", "batches", "thresholds",
               "workloads", "round_size", "dense_tokens", "out_dir")}
UNTRAINED_HEAD_FLAGS = {"confidence": (ExitConfig, "measure"), "exit_head": (ExitConfig, "head")}
FIT_FLAGS = {"rank": (TuneConfig, "backfill_rank"), "ridge": (TuneConfig, "backfill_ridge")}


@pytest.mark.parametrize("command,flags", [
    ("generate", ENGINE_FLAGS | UNTRAINED_HEAD_FLAGS),
    ("serve", ENGINE_FLAGS | SERVER_FLAGS | UNTRAINED_HEAD_FLAGS),
    ("compile", {k: v for k, v in ENGINE_FLAGS.items() if k in _subcommand("compile")}),
    ("eval", EVAL_FLAGS),
    ("fit-backfill", FIT_FLAGS),
])
def test_cli_defaults_are_the_configs(command, flags):
    """A flag's default is its field's (the parser builds without JAX, so it cannot read the
    serving classes; this holds the two together)."""
    actions = _subcommand(command)
    for dest, (cls, name) in flags.items():
        default = actions[dest].default
        want = getattr(cls(), name)
        assert (tuple(default) if isinstance(default, list) else default) == want, \
            f"ee-jax {command} --{dest.replace('_', '-')}: {default!r}, {cls.__name__}.{name} " \
            f"is {want!r}"


def test_cli_choices_are_the_libraries():
    """Choices the CLI spells out where their module imports JAX, and the ones it reads."""
    assert ("auto", *attention_kernels.BACKENDS) == cli.ATTENTION
    assert cli.CONTROL_MODES == controller.MODES
    assert cli.AOT_POLICIES == aot.POLICIES
    assert ("auto", *llama.LAYOUTS) == cli.LAYER_LAYOUTS
    for command in ("generate", "serve", "compile"):
        assert tuple(_subcommand(command)["attention"].choices) == cli.ATTENTION
    assert _subcommand("serve")["exit_control"].choices == cli.CONTROL_MODES
    policy = _subcommand("compile")["exit_policy"]
    assert (tuple(policy.choices), policy.default) == (aot.POLICIES, SERVING_POLICY)
