"""EE-Tuning's objective as pure functions (arXiv 2402.00518): the backbone is frozen, only
the exit heads learn.

Per exit e (after e layers), on every position of a packed batch:

    kl   = KL(p_final || p_exit)          self-distillation to the final layer (its teacher)
    ce   = -log p_exit(next real token)   keeps the head honest where the teacher is unsure
    bce  = BCE(classifier(h_e), [argmax p_exit == argmax p_final])   CALM's learned confidence

The backbone runs once per batch for all exits (`llama.forward(..., return_hidden=True)`),
under `stop_gradient`; exits are a `lax.scan` whose body is rematerialised, so only one
[B, T, V] logits array lives at a time.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ee_jax.models import llama
from ee_jax.models.config import ModelConfig
from ee_jax.models.exits import checks as exit_checks
from ee_jax.models.exits import heads as exit_heads
from ee_jax.models.exits.config import ExitConfig


@dataclasses.dataclass(frozen=True)
class LossWeights:
    kl: float = 1.0
    ce: float = 0.1
    classifier: float = 1.0


def trainable(heads: exit_heads.ExitHeads | dict) -> dict:
    """The parts tuning fits by gradient, as a dict (what the optimiser holds)."""
    parts = exit_heads.as_heads(heads).parts()
    return {k: v for k, v in parts.items() if k in ("norm", "adapter", "mlp")}


def _one_exit(params, head, h, logp_final, top_final, targets, cfg: ModelConfig):
    """Losses of one exit. head: that exit's slice of the heads' parts; h: [B, T, D]."""
    # the serving functions index slot 0
    one = exit_heads.as_heads(jax.tree.map(lambda a: a[None], head))
    logp = jax.nn.log_softmax(exit_heads.exit_logits(params, one, 0, h, cfg), axis=-1)  # [B, T, V]
    kl = jnp.sum(jnp.exp(logp_final) * (logp_final - logp), axis=-1)  # [B, T]
    ce = -jnp.take_along_axis(logp[:, :-1], targets[..., None], axis=-1)[..., 0]  # [B, T-1]
    top = jnp.argmax(logp, axis=-1)
    agree = (top == top_final).astype(jnp.float32)  # [B, T]
    metrics = {"kl": kl.mean(), "ce": ce.mean(), "agree": agree.mean()}
    if one.classifier is not None:
        frozen = one.replace(norm=jax.lax.stop_gradient(one.norm))
        conf_logit = exit_checks.classifier_logit(frozen, 0, h, cfg)
        bce = jnp.mean(jnp.logaddexp(0.0, conf_logit) - agree * conf_logit)  # stable BCE
        metrics["bce"] = bce
        metrics["cls_acc"] = jnp.mean((conf_logit > 0) == (agree > 0.5))
    return metrics


def exit_losses(heads, params: llama.Params, tokens: jax.Array, cfg: ModelConfig,
                ec: ExitConfig, w: LossWeights, remat: bool = True):
    """(scalar loss, metrics {name: [E]}) for a packed batch tokens [B, T]."""
    final_logits, hidden = llama.forward(params, tokens, cfg, return_hidden=True)
    final_logits, hidden = jax.lax.stop_gradient((final_logits, hidden))
    logp_final = jax.nn.log_softmax(final_logits, axis=-1)  # [B, T, V]
    top_final = jnp.argmax(final_logits, axis=-1)
    idx = jnp.asarray(ec.exit_layers, jnp.int32) - 1  # hidden[l] is after l + 1 layers
    hs = hidden[idx]  # [E, B, T, D]
    targets = tokens[:, 1:]

    def body(_, xs):
        head, h = xs
        return None, _one_exit(params, head, h, logp_final, top_final, targets, cfg)

    if remat:
        body = jax.checkpoint(body)
    _, m = jax.lax.scan(body, None, (heads, hs))  # each metric [E]
    loss = w.kl * m["kl"].sum() + w.ce * m["ce"].sum()
    if "bce" in m:
        loss = loss + w.classifier * m["bce"].sum()
    return loss, m


# --------------------------------------------------------------------------- restricted vocab


def restricted_kl(teacher: jax.Array, student: jax.Array, valid: jax.Array) -> jax.Array:
    """KL(p_teacher || p_student) with both distributions renormalised over the valid ids of
    a restricted vocabulary: teacher, student [..., S] logits at the same ids, valid [S].
    With every id of the vocabulary valid it is the full KL."""
    t = jax.nn.log_softmax(jnp.where(valid, teacher, exit_heads.MASKED), axis=-1)
    s = jax.nn.log_softmax(jnp.where(valid, student, exit_heads.MASKED), axis=-1)
    return jnp.sum(jnp.exp(t) * (t - s), axis=-1)


def restricted_exit_losses(heads, params: llama.Params, hs: jax.Array, final_normed: jax.Array,
                           vocab_ids: jax.Array, valid: jax.Array, target_pos: jax.Array,
                           cfg: ModelConfig, ec: ExitConfig, w: LossWeights):
    """(scalar loss, metrics {name: [E]}) from cached frozen-backbone states: hs [E, B, T, D]
    (hidden state at each exit), final_normed [B, T, D] (the final norm's output), over the
    restricted vocabulary vocab_ids [S] (valid [S]; the teacher's top-k at every position
    united with the real next tokens); target_pos [B, T-1] indexes each next token in
    vocab_ids. Logits cost S x D per position instead of V x D."""
    teacher = exit_heads.unembed_rows(params, final_normed, vocab_ids, cfg)  # [B, T, S]
    t_top = jnp.argmax(jnp.where(valid, teacher, exit_heads.MASKED), axis=-1)

    def body(_, xs):
        head, h = xs
        one = exit_heads.as_heads(jax.tree.map(lambda a: a[None], head))
        hn = exit_heads.exit_hidden(one, 0, h.astype(final_normed.dtype), cfg)
        student = exit_heads.unembed_rows(params, hn, vocab_ids, cfg)  # [B, T, S]
        kl = restricted_kl(teacher, student, valid)
        logp = jax.nn.log_softmax(jnp.where(valid, student, exit_heads.MASKED), axis=-1)
        ce = -jnp.take_along_axis(logp[:, :-1], target_pos[..., None], axis=-1)[..., 0]
        agree = (jnp.argmax(logp, axis=-1) == t_top).astype(jnp.float32)
        return None, {"kl": kl.mean(), "ce": ce.mean(), "agree": agree.mean()}

    _, m = jax.lax.scan(jax.checkpoint(body), None, (trainable(heads), hs))
    return w.kl * m["kl"].sum() + w.ce * m["ce"].sum(), m
