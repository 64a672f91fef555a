"""AdamW with linear warmup and cosine decay, global-norm clipping, and a weight-decay mask."""

from __future__ import annotations

import jax
import optax

from gdn.train.config import TrainConfig

# Decay parameters set the forgetting time scale; shrinking them toward zero would change what the model
# remembers, not regularise it. Norm gains and biases are 1-D and excluded by shape.
NO_DECAY_NAMES = ("A_log", "dt_bias")
EMBEDDING_NAMES = ("embed", "embedding")


def lr_shape(cfg: TrainConfig) -> optax.Schedule:
  """The learning rate over steps divided by its peak: linear warmup from 0 to 1 over `warmup_steps`, cosine
  decay to `min_lr_ratio` at `steps`. The rate at step t is `cfg.learning_rate * lr_shape(cfg)(t)`."""
  return optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=1.0, warmup_steps=cfg.warmup_steps,
                                            decay_steps=cfg.steps, end_value=cfg.min_lr_ratio)


def _names(path) -> tuple:
  return tuple(str(getattr(p, "key", getattr(p, "name", getattr(p, "idx", p)))) for p in path)


def decay_mask(params, decay_embeddings: bool = False):
  """True where weight decay applies: matrices and conv kernels, not decay parameters, norms or biases.

  Embeddings are excluded by default: with a large vocabulary (MQAR's 8192) most rows get no gradient in a
  step, so decoupled decay would pull the rows of rare tokens toward zero between their updates.
  """
  def rule(path, leaf):
    names = _names(path)
    if any(n in NO_DECAY_NAMES for n in names) or leaf.ndim < 2:
      return False
    if not decay_embeddings and any(n in EMBEDDING_NAMES for n in names):
      return False
    return True
  return jax.tree_util.tree_map_with_path(rule, params)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
  """Clipping, then AdamW at the peak learning rate, then the schedule's shape: -lr(t) (adam + wd p).

  The peak rate and AdamW's other numbers live in the optimizer state (`optax.inject_hyperparams`), not in
  the compiled train step, so the cells of a learning-rate grid share one program (and the persistent
  compilation cache, gdn/train/compile_cache.py).
  """
  adamw = optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
      learning_rate=cfg.learning_rate, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
      mask=lambda params: decay_mask(params, cfg.decay_embeddings))
  parts = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip > 0 else []
  return optax.chain(*parts, adamw, optax.scale_by_schedule(lr_shape(cfg)))


def _is_hp(x) -> bool:
  return isinstance(x, tuple) and hasattr(x, "hyperparams")  # optax's inject_hyperparams state


def peak_lr(opt_state):
  """The peak learning rate held in a `make_optimizer` state."""
  (hp,) = [s for s in jax.tree_util.tree_leaves(opt_state, is_leaf=_is_hp) if _is_hp(s)]
  return hp.hyperparams["learning_rate"]


def with_peak_lr(opt_state, learning_rate):
  """`opt_state` with its peak learning rate replaced: stacked cells (gdn/train/stacked.py) share one optimizer
  and hold their rates [N] in their states."""
  def put(s):
    return s._replace(hyperparams={**s.hyperparams, "learning_rate": learning_rate}) if _is_hp(s) else s
  return jax.tree_util.tree_map(put, opt_state, is_leaf=_is_hp)
