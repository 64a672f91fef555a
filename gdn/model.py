"""The language model: embeddings, a stack of pre-norm residual blocks following `ModelConfig.layer_kinds`, a head.

Shapes: B batch, T time (this device's slice under context parallelism), D d_model, Vocab vocabulary size.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from flax import nnx

from gdn.config import ModelConfig
from gdn.layers.attention import Attention
from gdn.layers.mlp import SwiGLU, hidden_size
from gdn.layers.norms import RMSNorm
from gdn.layers.recurrent import RecurrentMixer

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


class Block(nnx.Module):
  """x + mixer(norm(x)), then x + mlp(norm(x)) (no MLP when cfg.mlp_ratio is 0, as in Zoology's MQAR models)."""

  def __init__(self, cfg: ModelConfig, kind: str, *, rngs: nnx.Rngs):
    dtype = DTYPES[cfg.dtype]
    # Each block adds two residual branches; scaling their output projections by 1/sqrt(2 * num_layers) keeps
    # the residual stream's variance independent of depth (as GPT-2 does; fla's "rescale" option divides its
    # o_proj / down_proj init by the same factor).
    out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
    common = dict(init_std=cfg.init_std, out_init_std=out_std, dtype=dtype, rngs=rngs)
    self.kind = kind
    self.mixer_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    if kind == "recurrent":
      self.mixer = RecurrentMixer(cfg.recurrent, cfg.d_model, **common)
    elif kind in ("attention", "sliding_window"):
      window = cfg.attention.window if kind == "sliding_window" else 0
      self.mixer = Attention(cfg.attention, cfg.d_model, window=window, norm_eps=cfg.norm_eps, **common)
    else:
      raise ValueError(f"kind must be 'recurrent', 'attention' or 'sliding_window', got {kind!r}")
    has_mlp = cfg.mlp_ratio > 0
    self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps) if has_mlp else None
    self.mlp = SwiGLU(cfg.d_model, hidden_size(cfg.d_model, cfg.mlp_ratio), **common) if has_mlp else None

  def init_cache(self, batch: int, max_len: int):
    return self.mixer.init_cache(batch, max_len)

  def __call__(self, x, *, segment_ids=None, cache=None, context_axis=None):
    h, cache = self.mixer(self.mixer_norm(x), segment_ids=segment_ids, cache=cache, context_axis=context_axis)
    x = x + h
    return (x if self.mlp is None else x + self.mlp(self.mlp_norm(x))), cache


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
    self.blocks = nnx.List([Block(cfg, kind, rngs=rngs) for kind in cfg.layer_kinds])
    self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    self.lm_head = (None if cfg.tie_embeddings else
                    nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, kernel_init=init, dtype=dtype,
                               rngs=rngs))

  def __call__(self, tokens, *, segment_ids=None, context_axis=None):
    """tokens [B, T] -> logits [B, T, Vocab]. context_axis: None, or the name of a mesh axis over which the
    sequence is split, when called inside a `shard_map` over it: tokens and segment_ids are then this device's
    slice [B, T / D] (device d holding positions [d T / D, (d + 1) T / D)), and so are the logits."""
    self._check_tokens(tokens)
    if segment_ids is not None:
      if segment_ids.shape != tokens.shape:
        raise ValueError(f"segment_ids must be [B, T] = {tokens.shape}, got {segment_ids.shape}")
      if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise TypeError(f"segment_ids must be an integer array, got dtype {segment_ids.dtype}")
    logits, _ = self._run(tokens, segment_ids, None, context_axis)
    return logits

  def init_cache(self, batch: int, max_len: int) -> tuple:
    """One cache per layer: RecurrentCache (conv state, S) or KVCache; max_len bounds prompt + generated tokens."""
    if batch < 1 or max_len < 1:
      raise ValueError(f"batch and max_len must be positive ints, got batch={batch!r}, max_len={max_len!r}")
    return tuple(block.init_cache(batch, max_len) for block in self.blocks)

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

  def _run(self, tokens, segment_ids, cache, context_axis=None):
    x = self.embed(tokens)
    new_cache = []
    for i, block in enumerate(self.blocks):
      x, c = block(x, segment_ids=segment_ids, cache=None if cache is None else cache[i], context_axis=context_axis)
      new_cache.append(c)
    x = self.final_norm(x)
    logits = self.embed.attend(x) if self.lm_head is None else self.lm_head(x)
    return logits.astype(jnp.float32), (None if cache is None else tuple(new_cache))

  def _check_tokens(self, tokens):
    if tokens.ndim != 2:
      raise ValueError(f"tokens must be an integer array [B, T], got shape {tokens.shape}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise TypeError(f"tokens must be an integer array [B, T], got dtype {tokens.dtype}")

  def _check_cache(self, cache):
    if not isinstance(cache, (tuple, list)) or len(cache) != len(self.blocks):
      raise ValueError(f"cache must be a tuple of {len(self.blocks)} layer caches from init_cache, got "
                       f"{type(cache).__name__}")
