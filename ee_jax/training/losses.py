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

from ee_jax.models import exits, llama
from ee_jax.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class LossWeights:
    kl: float = 1.0
    ce: float = 0.1
    classifier: float = 1.0


def _one_exit(params, head, h, logp_final, top_final, targets, cfg: ModelConfig):
    """Losses of one exit. head: that exit's slice of the heads tree; h: [B, T, D]."""
    one = jax.tree.map(lambda a: a[None], head)  # the serving functions index slot 0
    logp = jax.nn.log_softmax(exits.exit_logits(params, one, 0, h, cfg), axis=-1)  # [B, T, V]
    kl = jnp.sum(jnp.exp(logp_final) * (logp_final - logp), axis=-1)  # [B, T]
    ce = -jnp.take_along_axis(logp[:, :-1], targets[..., None], axis=-1)[..., 0]  # [B, T-1]
    top = jnp.argmax(logp, axis=-1)
    agree = (top == top_final).astype(jnp.float32)  # [B, T]
    metrics = {"kl": kl.mean(), "ce": ce.mean(), "agree": agree.mean()}
    if "classifier" in head:
        frozen = dict(one, norm=jax.lax.stop_gradient(one["norm"]))
        conf_logit = exits.classifier_logit(frozen, 0, h, cfg)
        bce = jnp.mean(jnp.logaddexp(0.0, conf_logit) - agree * conf_logit)  # stable BCE
        metrics["bce"] = bce
        metrics["cls_acc"] = jnp.mean((conf_logit > 0) == (agree > 0.5))
    return metrics


def exit_losses(heads, params: llama.Params, tokens: jax.Array, cfg: ModelConfig,
                ec: exits.ExitConfig, w: LossWeights, remat: bool = True):
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
