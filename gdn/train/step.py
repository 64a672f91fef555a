"""The train state, the loss, and the pure jitted steps: `train_step(state, batch) -> (state, metrics)`."""

from __future__ import annotations

import contextlib
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from gdn.config import ModelConfig
from gdn.model import LanguageModel
from gdn.parallel import context_parallel_apply
from gdn.train import optimizer, sharding
from gdn.train.config import ConfigError


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: optimizer steps taken
  params: Any  # nnx.State of nnx.Param, float32 master weights
  rest: Any  # the model's other state (dropout RNG streams)
  opt_state: Any


def init(model_cfg: ModelConfig, tx: optax.GradientTransformation, seed):
  """(graphdef, TrainState) for a freshly initialised model; seed: an int, or a PRNG key (which can be traced:
  gdn/train/stacked.py vmaps this over the keys of several seeds)."""
  model = LanguageModel(model_cfg, rngs=nnx.Rngs(seed))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  return graphdef, TrainState(jnp.zeros((), jnp.int32), params, rest, tx.init(params))


def _token_stats(logits_BxTxV, batch):
  """Per-example sums over weighted positions: nll, correct tokens, weight; and whole-example correctness."""
  return _stats(*_nll_and_hit(logits_BxTxV, batch["targets"]), batch["weights"])


def _nll_and_hit(logits, targets):
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  return nll, (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)


def _chunked_token_stats(model: LanguageModel, x_BxTxD, batch, chunk: int):
  """`_token_stats(model.head(x), batch)` with the head applied to `chunk` positions of every row at a time and
  recomputed in the backward, so that the [B, T, Vocab] float32 logits (and their gradient) are never held
  whole: at vocabulary 32,000 they are 4 GiB for 8 x 4096 tokens, the largest tensors of a small model's step.
  The map runs over time, not over rows, so rows split over data-parallel devices stay split."""
  targets, w = batch["targets"], batch["weights"]
  B, T, D = x_BxTxD.shape
  pad = -T % chunk
  N = (T + pad) // chunk
  x_NxBxCxD = jnp.pad(x_BxTxD, ((0, 0), (0, pad), (0, 0))).reshape(B, N, chunk, D).swapaxes(0, 1)
  t_NxBxC = jnp.pad(targets, ((0, 0), (0, pad))).reshape(B, N, chunk).swapaxes(0, 1)

  @jax.checkpoint
  def one(xt):
    return _nll_and_hit(model.head(xt[0]), xt[1])

  nll, hit = jax.lax.map(one, (x_NxBxCxD, t_NxBxC))
  back = lambda a: a.swapaxes(0, 1).reshape(B, N * chunk)[:, :T]
  return _stats(back(nll), back(hit), w)


def _stats(nll_BxT, hit_BxT, w):
  w_B = w.sum(-1)
  has = (w_B > 0).astype(jnp.float32)
  # The last supervised position of a running state-tracking task is the state of the whole sequence.
  last_B = w.shape[1] - 1 - jnp.argmax(w[:, ::-1] > 0, axis=1)
  last_hit = jnp.take_along_axis(hit_BxT, last_B[:, None], axis=1)[:, 0]
  return dict(nll=(nll_BxT * w).sum(), correct=(hit_BxT * w).sum(), weight=w_B.sum(),
              seq_correct=(has * ((hit_BxT * w).sum(-1) == w_B)).sum(), last_correct=(has * last_hit).sum(),
              seqs=has.sum())


def supervised_positions(x_BxTxD, batch, M: int):
  """(x, batch) at the first M positions of every row, those with a positive weight first in time order, then
  weight-0 ones: the head applied there gives `_stats` the same sums (every weighted position, the last one
  last). A row with more than M weighted positions gets NaN weights, so its loss is NaN rather than short of
  some positions (`Task.max_supervised` bounds them; the train loop stops at a non-finite loss)."""
  w = batch["weights"]
  sup = w > 0
  order = jnp.argsort((~sup).astype(jnp.int32), axis=1, stable=True)[:, :M]  # [B, M]
  take = lambda a: jnp.take_along_axis(a, order.reshape(order.shape + (1,) * (a.ndim - 2)), axis=1)
  over = sup.sum(-1) > M
  weights = jnp.where(over[:, None], jnp.nan, take(w))
  return take(x_BxTxD), dict(batch, targets=take(batch["targets"]), weights=weights)


def model_stats(model: LanguageModel, batch, loss_chunk: int = 0, return_aux_loss: bool = False,
                supervised: int = 0):
  """The token statistics of `model` on `batch` (and the MoE load-balancing loss): the logits whole
  (loss_chunk 0) or `loss_chunk` positions of every row at a time; with `supervised` = M > 0 (below the
  length), only at each row's M positions of `supervised_positions` (train.supervised_head)."""
  out = model.features(batch["inputs"], return_aux_loss=return_aux_loss)
  x = out[0] if return_aux_loss else out
  if 0 < supervised < x.shape[1]:
    x, batch = supervised_positions(x, batch, supervised)
  with jax.named_scope("loss"):
    stats = _token_stats(model.head(x), batch) if loss_chunk <= 0 else _chunked_token_stats(model, x, batch,
                                                                                           loss_chunk)
  return (stats, out[1]) if return_aux_loss else stats


def _context_parallel_logits(model: LanguageModel, tokens, mesh):
  """`model(tokens)` with T split over the mesh's "seq" axis and B over ("data", "fsdp")."""
  D, T = sharding.seq_size(mesh), tokens.shape[1]
  halo = max([model.cfg.mixer_config(k).conv_size - 1 for k in set(model.cfg.layer_kinds)
              if k in ("recurrent", "mamba2") and model.cfg.mixer_config(k).short_conv], default=0)
  if -(-T // D) < halo:
    raise ConfigError(f"config.train.mesh_seq={D} splits sequences of {T} tokens into slices of {-(-T // D)}, "
                      f"fewer than the conv_size - 1 = {halo} steps that each device's short conv takes from "
                      "the previous device; use a smaller mesh_seq or longer sequences")
  return context_parallel_apply(model, tokens, mesh, axis_name=sharding.SEQ, batch_axis_name=sharding.AXES)


def _on_mesh(mesh):
  """Traces under `mesh` (layers that need activation shardings read it: `shard_alike_for_cudnn`)."""
  return contextlib.nullcontext() if mesh is None else jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


def make_train_step(graphdef, tx: optax.GradientTransformation, lr_shape, mesh=None, loss_chunk: int = 0,
                    supervised: int = 0):
  """`train_step_fn`'s step, jitted; the incoming state's buffers are donated (updated in place)."""
  return jax.jit(train_step_fn(graphdef, tx, lr_shape, mesh, loss_chunk, supervised), donate_argnums=0)


def train_step_fn(graphdef, tx: optax.GradientTransformation, lr_shape, mesh=None, loss_chunk: int = 0,
                  supervised: int = 0):
  """The pure step `(state, batch) -> (state, metrics)`, unjitted (gdn/train/stacked.py vmaps it).
  tx: `make_optimizer`'s; lr_shape: `optimizer.lr_shape(cfg)`, for the logged rate (its peak is read from the
  optimizer state); loss_chunk: train.loss_chunk (positions of every row per application of the output head in
  the loss; 0 = all at once); supervised: the positions of every row the head runs at (`model_stats`; 0 = all).

  mesh: None, or the `sharding.make_mesh` mesh the state and batches are sharded over: the model is traced
  under it, and the gradients are constrained to the parameters' FSDP sharding so that the sum over devices of
  the replicated parameters' gradients becomes a reduce-scatter. On a mesh with a "seq" axis (seq > 1) the
  forward runs under context parallelism.
  """
  context_parallel = mesh is not None and sharding.seq_size(mesh) > 1
  if context_parallel and loss_chunk > 0:
    raise ConfigError("config.train.loss_chunk > 0 is not supported with config.train.mesh_seq > 1: set "
                      "loss_chunk to 0")
  if context_parallel and supervised > 0:
    raise ConfigError("config.train.supervised_head is not supported with config.train.mesh_seq > 1: set it to "
                      "False")

  def loss_fn(params, rest, batch):
    model = nnx.merge(graphdef, params, rest)
    moe_coef = model.cfg.moe.aux_loss_coef if "moe" in model.cfg.mlp_kinds else 0.0
    aux = 0.0
    if context_parallel:
      if moe_coef:
        raise ConfigError("config.model.moe.aux_loss_coef > 0 is not supported with config.train.mesh_seq > 1 "
                          "(each device would balance only its own slice): set it to 0 or mesh_seq to 1")
      stats = _token_stats(_context_parallel_logits(model, batch["inputs"], mesh), batch)
    else:
      with _on_mesh(mesh):
        stats, aux = model_stats(model, batch, loss_chunk, return_aux_loss=True, supervised=supervised)
    # The MoE layers' load-balancing loss (gdn.layers.moe), weighted by moe.aux_loss_coef; 0 without MoE layers.
    loss = stats["nll"] / jnp.maximum(stats["weight"], 1.0) + moe_coef * aux
    _, _, rest = nnx.split(model, nnx.Param, ...)
    return loss, (stats, rest)

  def train_step(state: TrainState, batch):
    (loss, (stats, rest)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, state.rest, batch)
    if mesh is not None:
      grads = jax.lax.with_sharding_constraint(grads, sharding.tree_shardings(grads, mesh))
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    grad_norm = optax.global_norm(grads)
    # A non-finite loss or gradient drops the whole update (the state stays the step's input), so no state
    # the loop may checkpoint is ever non-finite; the loop reads `nonfinite` and stops or skips on.
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    new = TrainState(state.step + 1, params, rest, opt_state)
    new = jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, state)
    metrics = dict(loss=loss, accuracy=stats["correct"] / jnp.maximum(stats["weight"], 1.0),
                   grad_norm=grad_norm, lr=lr_shape(state.step) * optimizer.peak_lr(state.opt_state),
                   nonfinite=1.0 - finite.astype(jnp.float32))
    return new, metrics

  return train_step


def make_eval_step(graphdef, mesh=None, loss_chunk: int = 0, supervised: int = 0):
  """`eval_step_fn`'s step, jitted."""
  return jax.jit(eval_step_fn(graphdef, mesh, loss_chunk, supervised))


def eval_step_fn(graphdef, mesh=None, loss_chunk: int = 0, supervised: int = 0):
  """Sums of the eval statistics over one batch (summed again over batches on the host), unjitted. mesh,
  loss_chunk, supervised: as for `make_train_step`; eval never uses context parallelism."""

  def eval_step(params, rest, batch):
    model = nnx.merge(graphdef, params, rest)
    model.eval()  # dropout off
    with _on_mesh(mesh):
      return model_stats(model, batch, loss_chunk, supervised=supervised)

  return eval_step


def num_params(params) -> int:
  return sum(x.size for x in jax.tree_util.tree_leaves(params))
