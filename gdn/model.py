"""The language model: embeddings, a stack of pre-norm residual blocks following `ModelConfig.layer_kinds`, a head.

Shapes: B batch, T time (this device's slice under context parallelism), D d_model, Vocab vocabulary size,
G scanned groups (num_layers // len(pattern)), P len(pattern).

Two layouts of the same blocks. Unrolled (default): `blocks`, one Block per layer, applied in a Python loop.
Scanned (`cfg.scan_layers`): `scanned_blocks`, the P blocks of one pattern group whose parameters carry a leading
axis G (layer g * P + j is `scanned_blocks[j]` at index g), applied by one `lax.scan`, then `remainder_blocks`,
the num_layers - G P layers left over, unrolled. `stack_layers` / `unstack_layers` convert a model between them;
`for_decoding` gives either a lean copy for inference (fused projections, weights in the compute dtype).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdn.config import ModelConfig
from gdn.layers.attention import Attention
from gdn.layers.conv import ShortConv
from gdn.layers.embed import embed_lookup
from gdn.layers.fused import FusedLinear
from gdn.layers.mlp import SwiGLU, hidden_size
from gdn.layers.moe import Experts, MoE, load_balancing_loss
from gdn.layers.norms import RMSNorm
from gdn.layers.recurrent import RecurrentMixer
from gdn.ops.chunk import STATES, WRITES

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


class Block(nnx.Module):
  """x + mixer(norm(x)), then x + mlp(norm(x)) (no MLP when cfg.mlp_ratio is 0, as in Zoology's MQAR models)."""

  def __init__(self, cfg: ModelConfig, kind: str, *, rngs: nnx.Rngs, mlp_kind: str = "dense"):
    dtype = DTYPES[cfg.dtype]
    # Each block adds two residual branches; scaling their output projections by 1/sqrt(2 * num_layers) keeps
    # the residual stream's variance independent of depth (as GPT-2 does; fla's "rescale" option divides its
    # o_proj / down_proj init by the same factor).
    out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
    common = dict(init_std=cfg.init_std, out_init_std=out_std, dtype=dtype, rngs=rngs)
    self.kind = kind
    self.mixer_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    if kind in ("recurrent", "mamba2"):
      self.mixer = RecurrentMixer(cfg.mixer_config(kind), cfg.d_model, **common)
    elif kind in ("attention", "sliding_window"):
      window = cfg.attention.window if kind == "sliding_window" else 0
      self.mixer = Attention(cfg.attention, cfg.d_model, window=window, norm_eps=cfg.norm_eps, **common)
    else:
      raise ValueError(f"kind must be 'recurrent', 'mamba2', 'attention' or 'sliding_window', got {kind!r}")
    # No MLP when the dense width comes out 0 (mlp_ratio 0, mlp_hidden unset), as in Zoology's MQAR models.
    has_mlp = mlp_kind == "moe" or bool(cfg.mlp_hidden) or cfg.mlp_ratio > 0
    self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps) if has_mlp else None
    if not has_mlp:
      self.mlp = None
    elif mlp_kind == "moe":
      self.mlp = MoE(cfg.moe, cfg.d_model, **common)
    else:
      self.mlp = SwiGLU(cfg.d_model, cfg.mlp_hidden or hidden_size(cfg.d_model, cfg.mlp_ratio), **common)

  def init_cache(self, batch: int, max_len: int):
    return self.mixer.init_cache(batch, max_len)

  def __call__(self, x, *, segment_ids=None, cache=None, context_axis=None, router_stats=None):
    """router_stats: None, or a list to which an MoE MLP appends its routing statistics."""
    with jax.named_scope("norm"):
      h = self.mixer_norm(x)
    with jax.named_scope("attention" if isinstance(self.mixer, Attention) else "recurrent"):
      h, cache = self.mixer(h, segment_ids=segment_ids, cache=cache, context_axis=context_axis)
    x = x + h
    if self.mlp is None:
      return x, cache
    with jax.named_scope("norm"):
      h = self.mlp_norm(x)
    with jax.named_scope("mlp"):
      return x + (self.mlp(h, router_stats) if isinstance(self.mlp, MoE) else self.mlp(h)), cache


class LanguageModel(nnx.Module):
  """`logits = model(tokens)`: int32 [B, T] -> float32 [B, T, Vocab]; optional `segment_ids` [B, T] for packed
  sequences (recurrent states restart, attention stays within a segment, short convs do not cross).

  Inference: `cache = model.init_cache(B, max_len)`, `logits, cache = model.prefill(tokens, cache)` (any number
  of pieces), then `logits, cache = model.decode_step(token [B, 1], cache)`.

  Context parallelism (one long sequence split over a mesh axis): `gdn.parallel.context_parallel_apply`, which
  calls `model(tokens, context_axis=name)` inside a `shard_map` over that axis.

  Parameters are float32; `cfg.dtype` is the compute dtype. Initialisation: embeddings, projections and short
  convs normal(init_std); the two residual output projections of each block normal(init_std / sqrt(2 L));
  norms one; decay parameters as `gdn.layers.recurrent.init_decay`.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    if not isinstance(cfg, ModelConfig):
      raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    self.cfg = cfg
    dtype = DTYPES[cfg.dtype]
    init = nnx.initializers.normal(cfg.init_std)
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, embedding_init=init, dtype=dtype, rngs=rngs)
    # Built layer by layer in both layouts, so that the same seed gives the same parameters.
    blocks = [Block(cfg, kind, rngs=rngs, mlp_kind=mlp_kind)
              for kind, mlp_kind in zip(cfg.layer_kinds, cfg.mlp_kinds)]
    if cfg.scan_layers:
      G, P = cfg.scan_groups, len(cfg.pattern)
      groups = [nnx.List(blocks[g * P:(g + 1) * P]) for g in range(G)]
      self.scanned_blocks = groups[0]
      nnx.update(self.scanned_blocks, _stack([nnx.state(group) for group in groups]))
      self.remainder_blocks = nnx.List(blocks[G * P:])
    else:
      self.blocks = nnx.List(blocks)
    self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    self.lm_head = (None if cfg.tie_embeddings else
                    nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, kernel_init=init, dtype=dtype,
                               rngs=rngs))

  def __call__(self, tokens, *, segment_ids=None, context_axis=None, return_aux_loss: bool = False):
    """tokens [B, T] -> logits [B, T, Vocab]. context_axis: None, or the name of a mesh axis over which the
    sequence is split, when called inside a `shard_map` over it: tokens and segment_ids are then this device's
    slice [B, T / D] (device d holding positions [d T / D, (d + 1) T / D)), and so are the logits.
    return_aux_loss: return (logits, the MoE layers' load-balancing loss), 0 without MoE layers."""
    out = self.features(tokens, segment_ids=segment_ids, context_axis=context_axis, return_aux_loss=return_aux_loss)
    return (self.head(out[0]), out[1]) if return_aux_loss else self.head(out)

  def features(self, tokens, *, segment_ids=None, context_axis=None, return_aux_loss: bool = False):
    """tokens [B, T] -> the final-normed hidden states [B, T, D] that `head` turns into logits, so that a loss
    can apply the head to a few tokens at a time (gdn.train.step, train.loss_chunk); arguments as __call__."""
    self._check_tokens(tokens)
    if segment_ids is not None:
      if segment_ids.shape != tokens.shape:
        raise ValueError(f"segment_ids must be [B, T] = {tokens.shape}, got {segment_ids.shape}")
      if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise TypeError(f"segment_ids must be an integer array, got dtype {segment_ids.dtype}")
    stats = [] if return_aux_loss else None
    x, _ = self._run(tokens, segment_ids, None, context_axis, stats, head=False)
    return (x, load_balancing_loss(stats, self.cfg.moe.num_experts)) if return_aux_loss else x

  def head(self, x):
    """Final-normed hidden states [..., D] -> float32 logits [..., Vocab] (the tied embedding or lm_head)."""
    with jax.named_scope("head"):
      logits = self.embed.attend(x) if self.lm_head is None else self.lm_head(x)
      return logits.astype(jnp.float32)

  def __getattr__(self, name):
    # Only reached when normal lookup fails: say why a scanned model has no `blocks`.
    if name == "blocks" and getattr(self.__dict__.get("cfg"), "scan_layers", False):
      raise AttributeError("this model has scan_layers=True: its layers are stacked in `scanned_blocks` (and "
                           "`remainder_blocks`), not a per-layer `blocks` list; gdn.model.unstack_layers(model) "
                           "gives the same model unrolled")
    raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

  @property
  def unrolled_blocks(self):
    """The blocks applied one by one: every block, or with scan_layers the remainder after the scan."""
    return self.remainder_blocks if self.cfg.scan_layers else self.blocks

  def init_cache(self, batch: int, max_len: int) -> tuple:
    """One cache per layer: RecurrentCache (conv state, S) or KVCache; max_len bounds prompt + generated tokens.
    With scan_layers the first entry is the scanned group's P caches, each stacked along a leading axis G,
    followed by one cache per remainder layer."""
    if batch < 1 or max_len < 1:
      raise ValueError(f"batch and max_len must be positive ints, got batch={batch!r}, max_len={max_len!r}")
    caches = tuple(block.init_cache(batch, max_len) for block in self.unrolled_blocks)
    if not self.cfg.scan_layers:
      return caches
    G = self.cfg.scan_groups
    group = tuple(jax.tree.map(lambda a: jnp.broadcast_to(a, (G,) + a.shape), block.init_cache(batch, max_len))
                  for block in self.scanned_blocks)
    return (group,) + caches

  def prefill(self, tokens, cache: tuple):
    """Run tokens [B, T] from the cache's position (the chunked op for recurrent layers); (logits, cache)."""
    self._check_tokens(tokens)
    self._check_cache(cache)
    return self._run(tokens, None, cache)

  def decode_step(self, tokens, cache: tuple):
    """One token per row, tokens [B, 1] (or [B]); recurrent layers run `gated_delta_rule_step`."""
    if tokens.ndim == 1:
      tokens = tokens[:, None]
    self._check_tokens(tokens)
    if tokens.shape[1] != 1:
      raise ValueError(f"tokens must be [B, 1] for decode_step, got shape {tokens.shape}; use prefill")
    self._check_cache(cache)
    return self._run(tokens, None, cache)

  def _run(self, tokens, segment_ids, cache, context_axis=None, router_stats=None, head: bool = True):
    """router_stats: None, or a list to which MoE layers append their routing statistics (MoE layers are
    unrolled without remat, which ModelConfig checks, so the statistics never leave a scan or a checkpoint)."""
    with jax.named_scope("embed"):  # nnx.Embed's lookup, with a gradient that ignores repeats (gdn.layers.embed)
      x = embed_lookup(self.embed.embedding[...], tokens, self.embed.dtype)
    new_cache = []
    if self.cfg.scan_layers:
      x, c = self._scan(x, segment_ids, None if cache is None else cache[0], context_axis)
      new_cache.append(c)
      cache = None if cache is None else cache[1:]
    for i, block in enumerate(self.unrolled_blocks):
      c = None if cache is None else cache[i]
      if self.cfg.remat == "none":
        x, c = block(x, segment_ids=segment_ids, cache=c, context_axis=context_axis, router_stats=router_stats)
      else:
        graphdef, params, rest = nnx.split(block, nnx.Param, ...)
        x, c, rest = self._pure(graphdef, context_axis, prevent_cse=True)(params, rest, x, segment_ids, c)
        if _draws_rng(block, c):
          nnx.update(block, rest)
      new_cache.append(c)
    with jax.named_scope("norm"):
      x = self.final_norm(x)
    return self.head(x) if head else x, (None if cache is None else tuple(new_cache))

  def _scan(self, x, segment_ids, cache, context_axis):
    """The scanned group over its G slices of parameters, other state (each layer's dropout RNG stream) and
    cache; the updated RNG streams and caches come back stacked."""
    graphdef, params, rest = nnx.split(self.scanned_blocks, nnx.Param, ...)
    # The scan already keeps XLA from merging the recomputation with the forward, which prevent_cse would do.
    fn = self._pure(graphdef, context_axis, prevent_cse=False)

    def body(x, xs):
      x, c, rest = fn(*xs[:2], x, segment_ids, xs[2])
      return x, (rest, c)

    x, (rest, cache) = jax.lax.scan(body, x, (params, rest, cache))
    if _draws_rng(self.scanned_blocks, cache):
      nnx.update(self.scanned_blocks, rest)
    return x, cache

  def _pure(self, graphdef, context_axis, *, prevent_cse: bool):
    """(params, rest, x, segment_ids, cache) -> (x, cache, rest) for a Block or an nnx.List of them (one cache
    each), under `jax.checkpoint` with `cfg.remat`'s policy unless it is "none"."""

    def fn(params, rest, x, segment_ids, cache):
      module = nnx.merge(graphdef, params, rest)
      if isinstance(module, Block):
        x, cache = module(x, segment_ids=segment_ids, cache=cache, context_axis=context_axis)
      else:
        out = []
        for j, block in enumerate(module):
          x, c = block(x, segment_ids=segment_ids, cache=None if cache is None else cache[j],
                       context_axis=context_axis)
          out.append(c)
        cache = None if cache is None else tuple(out)
      return x, cache, nnx.split(module, nnx.Param, ...)[2]

    if self.cfg.remat == "none":
      return fn
    return jax.checkpoint(fn, policy=REMAT_POLICIES[self.cfg.remat], prevent_cse=prevent_cse)

  def _check_tokens(self, tokens):
    if tokens.ndim != 2:
      raise ValueError(f"tokens must be an integer array [B, T], got shape {tokens.shape}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise TypeError(f"tokens must be an integer array [B, T], got dtype {tokens.dtype}")
    if (isinstance(tokens, jax.core.Tracer) or not tokens.size
        or (isinstance(tokens, jax.Array) and not tokens.is_fully_addressable)):
      return  # traced tokens (an argument under jit), or a multi-process array this process cannot read whole
    # Concrete tokens (an eager call, or a constant under jit), read on the host: out of range, the embedding
    # gather would read NaN and every logit would be NaN, silently.
    t, V = np.asarray(tokens), self.cfg.vocab_size
    if t.min() < 0 or t.max() >= V:
      raise ValueError(f"tokens hold ids outside the model's vocabulary [0, {V}): min {t.min()}, max {t.max()}")

  def _check_cache(self, cache):
    n = len(self.unrolled_blocks) + int(self.cfg.scan_layers)
    if not isinstance(cache, (tuple, list)) or len(cache) != n:
      what = "the scanned group's caches and " if self.cfg.scan_layers else ""
      raise ValueError(f"cache must be a tuple of {n} entries ({what}one cache per unrolled layer) from "
                       f"init_cache, got {type(cache).__name__}"
                       + (f" of length {len(cache)}" if isinstance(cache, (tuple, list)) else ""))


# None of them: every activation is kept. "dots": matmul outputs without batch dimensions (the projections and
# MLPs; attention's and the chunked recurrence's batched products are recomputed). "dots_states": those, and the
# chunked recurrence's per-chunk states and write vectors (the state pass's results, `chunk.STATES` and
# `chunk.WRITES`), so that its sequential pass is not run again in the backward; the chunk-local work still is.
# "full": nothing inside a unit.
REMAT_POLICIES = {"dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                  "dots_states": jax.checkpoint_policies.save_from_both_policies(
                      jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                      jax.checkpoint_policies.save_only_these_names(STATES, WRITES)),
                  "full": jax.checkpoint_policies.nothing_saveable}


def _draws_rng(module, cache) -> bool:
  """Whether a call advanced the module's RNG streams: active dropout, outside decoding (a cached call never
  draws). Only then is the state written back, which a call traced inside a loop over the model must not do."""
  return cache is None and any(isinstance(m, nnx.Dropout) and m.rate > 0 and not m.deterministic
                               for _, m in nnx.iter_graph(module))


def _stack(trees):
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def _layout(model: LanguageModel, want_scan: bool) -> tuple:
  """(cfg, params, rest): the model's config with scan_layers=want_scan and its state as pure dicts."""
  if not isinstance(model, LanguageModel):
    raise TypeError(f"model must be a gdn.model.LanguageModel, got {type(model).__name__}")
  if model.cfg.scan_layers == want_scan:
    raise ValueError(f"model already has scan_layers={want_scan}")
  params, rest = nnx.state(model, nnx.Param, ...)
  return dataclasses.replace(model.cfg, scan_layers=want_scan), nnx.to_pure_dict(params), nnx.to_pure_dict(rest)


def _build(source: LanguageModel, cfg: ModelConfig, params: dict, rest: dict) -> LanguageModel:
  """A model of `cfg` holding the given state and `source`'s dropout mode (no initialisation is computed)."""
  modes = {m.deterministic for _, m in nnx.iter_graph(source) if isinstance(m, nnx.Dropout)}
  if len(modes) > 1:
    raise ValueError("the model's dropout layers are in different modes; call model.train() or model.eval() first")
  model = nnx.eval_shape(lambda: LanguageModel(cfg, rngs=nnx.Rngs(0)))
  params_state, rest_state = nnx.state(model, nnx.Param, ...)
  nnx.replace_by_pure_dict(params_state, params)
  nnx.replace_by_pure_dict(rest_state, rest)
  nnx.update(model, params_state, rest_state)
  for _, m in nnx.iter_graph(model):
    if isinstance(m, nnx.Dropout) and modes:
      m.deterministic = next(iter(modes))
  return model


def stack_layers(model: LanguageModel) -> LanguageModel:
  """The same model with scan_layers=True: the unrolled `blocks` stacked into `scanned_blocks` (layer g P + j at
  index g of block j) and `remainder_blocks`. Same parameters and RNG streams: the same logits and gradients."""
  cfg, params, rest = _layout(model, True)
  G, P = cfg.scan_groups, len(cfg.pattern)

  def convert(tree):
    tree = dict(tree)
    blocks = tree.pop("blocks", {})
    # A block without state of a kind (attention has no RNG stream) is absent from that kind's dict.
    tree["scanned_blocks"] = {j: _stack([blocks[g * P + j] for g in range(G)]) for j in range(P) if j in blocks}
    tree["remainder_blocks"] = {i - G * P: blocks[i] for i in blocks if i >= G * P}
    return tree

  return _build(model, cfg, convert(params), convert(rest))


def unstack_layers(model: LanguageModel) -> LanguageModel:
  """The inverse of `stack_layers`: the same model with scan_layers=False and one Block per layer in `blocks`
  (the layout of unrolled checkpoints and of the interop loaders)."""
  cfg, params, rest = _layout(model, False)
  G, P = model.cfg.scan_groups, len(cfg.pattern)

  def convert(tree):
    tree = dict(tree)
    groups, remainder = tree.pop("scanned_blocks", {}), tree.pop("remainder_blocks", {})
    blocks = {g * P + j: jax.tree.map(lambda x, g=g: x[g], block) for j, block in groups.items() for g in range(G)}
    blocks.update({G * P + i: block for i, block in remainder.items()})
    tree["blocks"] = blocks
    return tree

  return _build(model, cfg, convert(params), convert(rest))


# The parameters that a module only ever reads cast to its compute dtype (`module.dtype`): casting them once
# gives the same values. Norm weights, A_log and dt_bias are left alone: they are read in float32.
_COMPUTE_DTYPE_PARAMS = ((nnx.Linear, ("kernel", "bias")), (FusedLinear, ("kernel", "bias")),
                         (nnx.Embed, ("embedding",)), (ShortConv, ("weight", "bias")),
                         (Experts, ("gate_proj", "up_proj", "down_proj")))


def for_decoding(model: LanguageModel, *, unroll: bool = False, mlp_multiple: int | None = 256) -> LanguageModel:
  """The same model, made lean for inference (`prefill`, `decode_step`, `gdn.generate`): the projections that
  read the same input fused into one matmul per module (a recurrent layer's q, k, v, decay, beta and gate; an
  attention layer's q, k, v; an MLP's gate and up), and every weight that is only read in the compute dtype
  stored in it. Both layouts, unrolled and scanned (`scan_layers`: one layer body, the stacked weights fused
  along their last axis). `model` is left unchanged.

  Why: parameters are float32 and `cfg.dtype` is the compute dtype, so each step of a bfloat16 model casts every
  weight again (reading 4 bytes and writing 2 per weight before the matmul reads 2) unless XLA hoists the casts
  out of the decode loop (its CPU backend does, and then holds both copies); and at batch 1 a decode step is a
  chain of small kernels, where each of a layer's matmuls is a launch of its own. The logits equal the model's
  to float32 rounding (each fused column is the same dot product). The result is for inference only: its
  parameters no longer have the layout of checkpoints, `stack_layers` or the interop loaders, and training it
  would train the rounded weights.

  unroll: return a scanned model unrolled (`unstack_layers` first). A scanned step slices each layer's weights
  out of the stacks, and a backend may copy every slice before its matmul (XLA's CPU program does), reading the
  weights up to three times; the unrolled step reads them where they lie, for a longer compile.

  mlp_multiple: widen every dense SwiGLU's hidden layer with zero weights to a multiple of this (256, as fla
  rounds its widths; None or 1 keeps it): the same outputs, for matmuls that tile the width without padding it
  (`SwiGLU.fuse`). On the H200 a batch-1 step of the 12-layer d_model-2048 model (width 5464, which XLA's split-K
  matmul padded to 5504 in every step) went from 1.075 to 0.865 ms with 256, for 2% more weight bytes
  (results/benchmarks/h200_2026-12-02/decode_mlp_multiple.txt).
  """
  if not isinstance(model, LanguageModel):
    raise TypeError(f"model must be a gdn.model.LanguageModel, got {type(model).__name__}")
  if mlp_multiple is not None and not (isinstance(mlp_multiple, int) and mlp_multiple >= 1):
    raise ValueError(f"mlp_multiple must be a positive int or None, got {mlp_multiple!r}")
  model = unstack_layers(model) if unroll and model.cfg.scan_layers else nnx.clone(model)
  for _, m in list(nnx.iter_graph(model)):  # listed first: fusing changes the graph
    if isinstance(m, SwiGLU):
      m.fuse(mlp_multiple)
    elif isinstance(m, (RecurrentMixer, Attention)):
      m.fuse()
  for _, m in nnx.iter_graph(model):
    for kind, names in _COMPUTE_DTYPE_PARAMS:
      dtype = getattr(m, "dtype", None)
      if isinstance(m, kind) and dtype is not None:
        for name in names:
          p = getattr(m, name)
          if p is not None and p[...].dtype != dtype:
            p.set_value(p[...].astype(dtype))
  return model
