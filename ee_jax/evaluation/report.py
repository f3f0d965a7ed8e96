"""The evaluation report: a markdown file and two plots (matplotlib, Agg backend).

    <out>/eval.md                   tables, with the command, date and machine
    <out>/eval_speed_quality.png    speedup vs full depth against token agreement and ROUGE-L
    <out>/eval_layers.png           per-layer agreement and reliability, untrained vs tuned
"""

from __future__ import annotations

import dataclasses
import math
import os
import platform
from pathlib import Path

import jax

from ee_jax.evaluation.layerwise import ExitPredictions
from ee_jax.evaluation.simulate import SimulatedExits
from ee_jax.evaluation.sweep import FULL, SweepRow
from ee_jax.models.exits.config import ExitConfig

MARKDOWN = "eval.md"
SPEED_PLOT = "eval_speed_quality.png"
LAYER_PLOT = "eval_layers.png"


@dataclasses.dataclass
class EvalReport:
    command: str
    date: str
    model: str
    heads: str  # where the tuned heads came from
    exit_config: ExitConfig  # the tuned heads' config (policy/threshold are swept)
    n_layers: int
    # corpus -> variant ("untrained" / "tuned") -> predictions
    layers: dict[str, dict[str, ExitPredictions]] = dataclasses.field(default_factory=dict)
    simulations: dict[str, dict[str, list[SimulatedExits]]] = dataclasses.field(
        default_factory=dict)
    sweep: list[SweepRow] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    machine: str = dataclasses.field(default_factory=lambda: machine())


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    dev = jax.devices()[0]
    return (f"{cpu}, {os.cpu_count()} logical CPUs; jax {jax.__version__}, backend "
            f"{jax.default_backend()} ({len(jax.devices())} x {dev.device_kind})")


def _f(x: float | None, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.{digits}f}"


def _hist(counts: dict[int, int]) -> str:
    return " ".join(f"{k}:{v}" for k, v in sorted(counts.items())) or "–"


def render_markdown(r: EvalReport) -> str:
    ec = r.exit_config
    out = ["# Early-exit evaluation (`ee-jax eval`)", "",
           f"Command: `{r.command}`  ", f"Date: {r.date}  ", f"Machine: {r.machine}  ",
           f"Model: {r.model} ({r.n_layers} layers)  ",
           f"Tuned heads: {r.heads} — exits {list(ec.exit_layers)}, head `{ec.head}`, "
           f"measure `{ec.measure}`, min exit layer {ec.min_exit_layer}  ",
           "Untrained heads: per-exit norm = the final norm, the model's own LM head, "
           "confidence `max_prob`, same exit layers.", ""]
    out += [f"- {n}" for n in r.notes] + ([""] if r.notes else [])
    if r.layers:
        out += _layer_section(r)
    if r.simulations:
        out += _simulation_section(r)
    if r.sweep:
        out += _sweep_section(r)
    return "\n".join(out).rstrip() + "\n"


def _layer_section(r: EvalReport) -> list[str]:
    out = ["## 1. Per exit layer, on held-out text (dense, teacher-forced)", "",
           "Agreement: the exit's top-1 token equals the final layer's, at every position of "
           "the text. Calibration: confidence (the heads' own measure) against that "
           "agreement, in 10 equal-width bins; ECE = sum over bins of (share of tokens) x "
           "|agreement - mean confidence|. Plot: "
           f"[{LAYER_PLOT}]({LAYER_PLOT}).", ""]
    for corpus, variants in r.layers.items():
        names = list(variants)
        n = next(iter(variants.values())).num_tokens
        out += [f"### {corpus} ({n} tokens)", "",
                "| exit layer | " + " | ".join(f"agreement {v}" for v in names) + " | "
                + " | ".join(f"ECE {v}" for v in names) + " | "
                + " | ".join(f"mean conf. {v}" for v in names) + " |",
                "|---" * (1 + 3 * len(names)) + "|"]
        stats = {v: p.layer_stats() for v, p in variants.items()}
        for i, e in enumerate(next(iter(variants.values())).exit_layers):
            cells = ([_f(stats[v][i].agreement) for v in names]
                     + [_f(stats[v][i].ece) for v in names]
                     + [_f(stats[v][i].mean_confidence) for v in names])
            out.append(f"| {e} | " + " | ".join(cells) + " |")
        out += ["", "Reliability, all exits pooled (tokens / mean confidence / agreement "
                "per confidence bin):", "",
                "| confidence | " + " | ".join(names) + " |", "|---" * (1 + len(names)) + "|"]
        rels = {v: p.reliability() for v, p in variants.items()}
        edges = next(iter(rels.values())).edges
        for b in range(len(edges) - 1):
            cells = [f"{rel.count[b]} / {_f(rel.confidence[b], 2)} / {_f(rel.accuracy[b], 2)}"
                     if rel.count[b] else "0" for rel in rels.values()]
            out.append(f"| [{edges[b]:.1f}, {edges[b + 1]:.1f}) | " + " | ".join(cells) + " |")
        out.append("| ECE | " + " | ".join(_f(rel.ece) for rel in rels.values()) + " |")
        out.append("")
    return out


def _simulation_section(r: EvalReport) -> list[str]:
    L = r.n_layers
    out = ["## 2. Teacher-forced simulation of batch-1 exits (same dense pass)", "",
           "Each token leaves at its first exit (>= min exit layer) whose confidence reaches "
           f"the threshold, else runs all {L} layers; the context is always the real text. "
           "Agreement: the token it leaves with equals the final layer's. Ideal speedup = "
           f"{L} / mean layers (no overheads).", "",
           "| corpus | heads | threshold | mean layers | ideal speedup | agreement | "
           "tokens per exit layer |", "|---|---|---|---|---|---|---|"]
    for corpus, variants in r.simulations.items():
        for v, sims in variants.items():
            for s in sims:
                out.append(f"| {corpus} | {v} | {s.threshold:g} | {s.mean_layers:.1f} | "
                           f"{s.ideal_speedup:.2f}x | {_f(s.agreement)} | {s.histogram()} |")
    return [*out, ""]


def _sweep_section(r: EvalReport) -> list[str]:
    L = r.n_layers
    out = ["## 3. End to end, serving engine, greedy", "",
           "One engine per policy (thresholds per request) and one at full depth (policy "
           "`never`), same process, prompts in rounds (full depth then every configuration), "
           "after warm-up; steps that compile are excluded. Speedup: decode tokens/s over "
           "full depth's at the same batch. Mean layers: layers executed per generated token "
           "(under all/quorum every row runs its step's exit layer, under per_row its own; "
           f"ideal speedup = {L} / mean); layers/token: the same mean, from the per-token "
           "exit layers. At batch 1 only the first policy runs (one row: every rule is the "
           "same). "
           "Teacher-forced (TF) agreement: "
           "fed the full-depth tokens, the token the engine predicts at each decode step "
           "equals the full-depth one (the prefill's first token excluded). Free-running, "
           "against the full-depth output of the same prompt: prefix = tokens before the "
           "first difference / full-depth tokens; match = equal positions / longer length; "
           "ROUGE-L F on token ids (mean over prompts); identical = whole sequence equal. "
           "NLL: the full model's mean negative log-likelihood (nats per token) of the "
           f"generated tokens. Plot: [{SPEED_PLOT}]({SPEED_PLOT}).", "",
           "| workload | batch | config | prompts | tokens | decode tok/s | speedup | "
           "mean layers | ideal | layers/token | TF agreement | prefix | match | ROUGE-L | "
           "identical | NLL |", "|---" * 16 + "|"]
    for row in r.sweep:
        out.append(f"| {row.workload} | {row.batch} | {row.label} | {row.num_prompts} | "
                   f"{row.num_tokens} | {row.decode_tokens_per_s:.1f} | {row.speedup:.2f}x | "
                   f"{row.mean_layers:.1f} | {row.ideal_speedup:.2f}x | "
                   f"{row.mean_token_layers:.1f} | {_f(row.tf_agreement)} | "
                   f"{_f(row.prefix_agreement)} | "
                   f"{_f(row.match_rate)} | {_f(row.rouge_l)} | {_f(row.identical, 2)} | "
                   f"{_f(row.nll)} |")
    out += ["", "Exit histograms (layer:count; free running): batch exit layer per decode "
            "step, and exit layer per decode token. Compile s: all the engine compiled (warm-up "
            "included; shared by its thresholds and workloads), excluded from the speeds.", "",
            "| workload | batch | config | per decode step | per decode token | compile s |",
            "|---|---|---|---|---|---|"]
    for row in r.sweep:
        out.append(f"| {row.workload} | {row.batch} | {row.label} | "
                   f"{_hist(row.step_exit_counts)} | {_hist(row.token_exit_counts)} | "
                   f"{row.compile_time:.1f} |")
    return [*out, ""]


# --------------------------------------------------------------------------- plots


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_speed_quality(rows: list[SweepRow], path: Path) -> None:
    plt = _pyplot()
    workloads = list(dict.fromkeys(r.workload for r in rows))
    metrics = (("tf_agreement", "teacher-forced token agreement"), ("rouge_l", "ROUGE-L F"))
    fig, axes = plt.subplots(len(workloads), 2, figsize=(11, 4.2 * len(workloads)),
                             squeeze=False)
    policies = list(dict.fromkeys(r.policy for r in rows if r.policy != FULL))
    colors = {p: f"C{i + 1}" for i, p in enumerate(policies)} | {FULL: "black"}
    markers = {1: "o", 8: "s"}
    for i, w in enumerate(workloads):
        for j, (attr, name) in enumerate(metrics):
            ax = axes[i][j]
            for r in (r for r in rows if r.workload == w):
                y = getattr(r, attr)
                ax.scatter(r.speedup, y, color=colors[r.policy],
                           marker=markers.get(r.batch, "^"), s=40,
                           facecolors="none" if r.batch != 1 else colors[r.policy])
                if r.policy != FULL:
                    ax.annotate(f"{r.threshold:g}", (r.speedup, y), fontsize=7,
                                xytext=(3, 3), textcoords="offset points")
            for pol in policies:  # one curve per (policy, batch), in threshold order
                for b in sorted({r.batch for r in rows}):
                    pts = sorted((r.threshold, r.speedup, getattr(r, attr)) for r in rows
                                 if (r.workload, r.policy, r.batch) == (w, pol, b))
                    ax.plot([p[1] for p in pts], [p[2] for p in pts], color=colors[pol],
                            lw=0.8, alpha=0.5, ls="-" if b == 1 else "--")
            ax.axvline(1.0, color="grey", lw=0.5, ls=":")
            ax.set_xlabel("decode speedup vs full depth (same batch)")
            ax.set_ylabel(name)
            ax.set_title(f"{w}: {name}", fontsize=10)
            ax.grid(alpha=0.3)
    handles = [plt.Line2D([], [], color=c, marker="o", ls="", label=p)
               for p, c in colors.items() if p in policies or p == FULL]
    handles += [plt.Line2D([], [], color="grey", marker=m, ls="",
                           markerfacecolor="grey" if b == 1 else "none", label=f"batch {b}")
                for b, m in markers.items() if any(r.batch == b for r in rows)]
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.45 / fig.get_figheight()))
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=8,
               title="speed vs quality; point labels: exit threshold", title_fontsize=9,
               bbox_to_anchor=(0.5, 1.0), frameon=False)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_layers(layers: dict[str, dict[str, ExitPredictions]], path: Path) -> None:
    plt = _pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {"untrained": "--", "tuned": "-"}
    for ci, (corpus, variants) in enumerate(layers.items()):
        for v, pred in variants.items():
            ax.plot(pred.exit_layers, pred.agreement(), styles.get(v, "-."), marker="o",
                    ms=3, color=f"C{ci}", label=f"{corpus}, {v}")
            rel = pred.reliability()
            full = rel.count > 0
            ax2.plot(rel.confidence[full], rel.accuracy[full], styles.get(v, "-."),
                     marker="o", ms=3, color=f"C{ci}", label=f"{corpus}, {v} "
                     f"(ECE {rel.ece:.3f})")
    ax.set_xlabel("exit layer (layers run)")
    ax.set_ylabel("top-1 agreement with the final layer")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("Agreement per exit layer", fontsize=10)
    ax2.plot([0, 1], [0, 1], color="grey", lw=0.5)
    ax2.set_xlabel("confidence (bin mean)")
    ax2.set_ylabel("agreement with the final layer")
    ax2.set_xlim(0, 1)
    ax2.set_ylim(0, 1)
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=7)
    ax2.set_title("Reliability, all exits pooled", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(r: EvalReport, out_dir: str | os.PathLike) -> list[Path]:
    """Write eval.md and the plots that have data; returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / MARKDOWN]
    paths[0].write_text(render_markdown(r), encoding="utf-8")
    if r.sweep:
        plot_speed_quality(r.sweep, out / SPEED_PLOT)
        paths.append(out / SPEED_PLOT)
    if r.layers:
        plot_layers(r.layers, out / LAYER_PLOT)
        paths.append(out / LAYER_PLOT)
    return paths
