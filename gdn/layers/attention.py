"""Causal softmax attention: RoPE (full or partial, plain or YaRN), GQA, sliding window, sigmoid output gate, KV cache,
context parallelism (the sequence split over a mesh axis, keys and values all-gathered).

Shapes: B batch, T new tokens (this device's slice under context parallelism), L cache slots, S keys attended
(L + T; the whole sequence under context parallelism), D d_model, N q heads, G kv heads, E head dim.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from gdn.config import AttentionConfig
from gdn.layers.fused import fuse_projections, lean, project
from gdn.layers.norms import RMSNorm
from gdn.layers.rope import frequencies, rope
from gdn.layers.segments import check_mixer_call, segment_index


class KVCache(NamedTuple):
  """A ring buffer of keys and values: slot p % L holds position p. Global layers get L = max_len (no wrap
  within capacity), sliding-window layers L = min(window, max_len). Head-major, so that a decode step's two
  products read each head's L x E block where it lies: in [B, L, G, E] XLA copied K and V to that layout at
  every step (reading and writing the whole cache before the products read it)."""
  k: jax.Array  # [B, G, L, E] (rotated keys)
  v: jax.Array  # [B, G, L, E]
  kpos: jax.Array  # [L] int32 position held by each slot, -1 when empty
  pos: jax.Array  # [] int32 number of tokens seen


def shard_alike_for_cudnn(q, k, v):
  """q, k, v [B, T, *, E] pinned to one sharding: the batch split over the context mesh's axes (replicated if B
  does not divide), or unchanged outside a mesh context.

  cuDNN attention's partitioner refuses q, k and v sharded differently, or along T or E; under FSDP, sharding
  propagation can give the three projections' outputs different shardings. The train and eval steps trace the
  model under their mesh (`jax.sharding.use_abstract_mesh`) so that this finds it.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or any(t == jax.sharding.AxisType.Manual for t in mesh.axis_types):
    return q, k, v
  axes = tuple(n for n, size in zip(mesh.axis_names, mesh.axis_sizes) if size > 1)
  if not axes:
    return q, k, v
  spec = P(axes) if q.shape[0] % math.prod(mesh.shape[n] for n in axes) == 0 else P()
  return tuple(jax.lax.with_sharding_constraint(x, spec) for x in (q, k, v))


class Attention(nnx.Module):
  """Causal multi-head attention with GQA. window > 0: each query sees itself and the window-1 tokens before it.

  output_gate "sigmoid" is Qwen3-Next's gated attention: q_proj also yields a per-channel gate, and the
  attention output is multiplied by sigmoid(gate) before o_proj. qk_norm applies RMSNorm per head before RoPE.
  proj_bias gives the q, k, v and o projections biases (zero at init).
  """

  def __init__(self, cfg: AttentionConfig, d_model: int, *, window: int = 0, init_std: float = 0.02,
               out_init_std=None, norm_eps: float = 1e-6, dtype=jnp.float32, rngs: nnx.Rngs):
    if not isinstance(cfg, AttentionConfig):
      raise TypeError(f"cfg must be an AttentionConfig, got {type(cfg).__name__}")
    if window < 0:
      raise ValueError(f"window must be >= 0, got {window}")
    self.cfg = cfg
    self.d_model = d_model
    self.window = window
    self.dtype = dtype
    N, G, E = cfg.num_heads, cfg.KVH, cfg.head_dim
    self.rot_dim = int(E * cfg.rope_fraction) // 2 * 2
    inv_freq, self.rope_scale = frequencies(cfg, self.rot_dim)
    self.inv_freq = tuple(inv_freq.tolist())  # static constants, not parameters
    init = nnx.initializers.normal(init_std)
    out_init = nnx.initializers.normal(init_std if out_init_std is None else out_init_std)
    gated = cfg.output_gate == "sigmoid"
    lin = lambda n_in, n_out, ki=init: nnx.Linear(n_in, n_out, use_bias=cfg.proj_bias, kernel_init=ki,
                                                   dtype=dtype, rngs=rngs)
    self.q_proj = lin(d_model, N * E * (2 if gated else 1))
    self.k_proj = lin(d_model, G * E)
    self.v_proj = lin(d_model, G * E)
    self.o_proj = lin(N * E, d_model, out_init)
    self.q_norm = RMSNorm(E, eps=norm_eps) if cfg.qk_norm else None
    self.k_norm = RMSNorm(E, eps=norm_eps) if cfg.qk_norm else None
    self.in_proj = None  # q, k, v as one FusedLinear, after `fuse` (inference)

  def fuse(self):
    """In place, for inference: the q, k and v projections become one matmul, the output projection a
    `LeanLinear` (the same matmul, with the inference path's handling of one row)."""
    fuse_projections(self, ("q_proj", "k_proj", "v_proj"))
    self.o_proj = lean(self.o_proj)

  def init_cache(self, batch: int, max_len: int) -> KVCache:
    if max_len < 1:
      raise ValueError(f"max_len must be a positive int, got {max_len!r}")
    L = min(self.window, max_len) if self.window else max_len
    shape = (batch, self.cfg.KVH, L, self.cfg.head_dim)
    return KVCache(jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype), jnp.full((L,), -1, jnp.int32),
                   jnp.zeros((), jnp.int32))

  def implementation(self, dtype, has_mask: bool):
    """The `implementation` that `jax.nn.dot_product_attention` gets for inputs of `dtype` (with or without a
    dense mask): "cudnn" where cuDNN takes them under "auto", None for XLA's."""
    impl = self.cfg.implementation
    if impl != "auto":
      return None if impl == "xla" else impl
    # cuDNN's fused attention takes 16-bit inputs and no dense mask; everything else goes through XLA.
    ok = (jax.default_backend() == "gpu" and jnp.dtype(dtype).itemsize == 2 and not has_mask
          and self.cfg.head_dim % 8 == 0 and self.cfg.head_dim <= 128)
    return "cudnn" if ok else None

  def __call__(self, x, *, segment_ids=None, cache: Optional[KVCache] = None, context_axis=None):
    """x [B, T, D] -> (y [B, T, D], new cache or None). A cache continues at cache.pos; past its L slots the
    layer attends over a window of L positions (`_attend_cached`), in prefill pieces and decode steps alike.

    context_axis: None, or the name of a mesh axis over which the sequence is split (inside a `shard_map`,
    device d holding positions [d T, (d + 1) T)): x and segment_ids are this device's slice; its queries
    attend over the keys and values of every device's slice (`_attend_gathered`).
    """
    cfg = self.cfg
    check_mixer_call(x, self.d_model, segment_ids, cache)
    if context_axis is not None and cache is not None:
      raise ValueError("a KV cache cannot be combined with context_axis: decoding runs on one device")
    B, T, _ = x.shape
    N, G, E = cfg.num_heads, cfg.KVH, cfg.head_dim

    p = project(self, ("q_proj", "k_proj", "v_proj"), x)
    q = p["q_proj"]
    gate = None
    if cfg.output_gate == "sigmoid":
      q, gate = jnp.split(q.reshape(B, T, N, 2 * E), 2, axis=-1)
    q = q.reshape(B, T, N, E)
    k = p["k_proj"].reshape(B, T, G, E)
    v = p["v_proj"].reshape(B, T, G, E)
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    if context_axis is not None:
      pos0 = jax.lax.axis_index(context_axis).astype(jnp.int32) * T
    else:
      pos0 = jnp.zeros((), jnp.int32) if cache is None else cache.pos
    positions = pos0 + jnp.arange(T, dtype=jnp.int32)
    q = rope(q, positions, self.inv_freq, self.rope_scale)
    k = rope(k, positions, self.inv_freq, self.rope_scale)

    if segment_ids is not None and segment_ids.shape != (B, T):
      raise ValueError(f"segment_ids must be [B, T] = {(B, T)}, got {segment_ids.shape}")
    if context_axis is not None:
      o, new_cache = self._attend_gathered(q, k, v, positions, segment_ids, context_axis), None
    elif cache is None:
      mask = None
      if segment_ids is not None:
        seg = segment_index(segment_ids)
        mask = (seg[:, :, None] == seg[:, None, :])[:, None]
      impl = self.implementation(q.dtype, mask is not None)
      if impl == "cudnn":
        q, k, v = shard_alike_for_cudnn(q, k, v)
      o = jax.nn.dot_product_attention(
          q, k, v, mask=mask, is_causal=True,
          local_window_size=(self.window - 1, 0) if self.window else None, implementation=impl)
      new_cache = None
    else:
      o, new_cache = self._attend_cached(q, k, v, positions, cache)

    if gate is not None:
      o = (o.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(o.dtype)
    return self.o_proj(o.reshape(B, T, N * E)), new_cache

  def _attend_gathered(self, q, k, v, positions, segment_ids, axis_name):
    """This device's queries [B, T, N, E] at global `positions` [T] over the keys and values of every device's
    slice along `axis_name`, all-gathered to [B, S, G, E] (S = D T; the backward reduce-scatters their
    cotangents). The causal mask is built from global positions: the `is_causal` flag of
    `dot_product_attention` assumes the queries start at key 0."""
    T = q.shape[1]
    gather = lambda a: jax.lax.all_gather(a, axis_name, axis=1, tiled=True)
    kk, vv = gather(k), gather(v)
    kpos = jnp.arange(kk.shape[1], dtype=jnp.int32)  # [S]
    ok = kpos[None, :] <= positions[:, None]  # [T, S]
    if self.window:
      ok = ok & (positions[:, None] - kpos[None, :] < self.window)
    ok = ok[None, None]
    if segment_ids is not None:
      # Segments are numbered over the whole sequence (a segment may start on a slice boundary or span slices);
      # a row's ids are T integers per device, small beside its keys.
      seg = segment_index(gather(segment_ids))  # [B, S]
      seg_q = jax.lax.dynamic_slice_in_dim(seg, positions[0], T, axis=1)  # [B, T]
      ok = ok & (seg_q[:, :, None] == seg[:, None, :])[:, None]
    return jax.nn.dot_product_attention(q, kk, vv, mask=ok, implementation=self.implementation(q.dtype, True))

  def _attend_cached(self, q, k, v, positions, cache: KVCache):
    """Attend over [cached keys, new keys] (before writing, so a ring slot about to be overwritten still counts)
    and write the last min(T, L) new keys into their slots; one decoded token attends over the written cache."""
    B, T = q.shape[:2]
    L = cache.kpos.shape[0]
    if cache.k.shape[0] != B:
      raise ValueError(f"cache batch {cache.k.shape[0]} does not match x's batch {B}")
    n = min(T, L)
    slots = positions[T - n:] % L
    heads = lambda a: jnp.swapaxes(a, 1, 2).astype(cache.k.dtype)  # [B, T, G, E] -> [B, G, T, E]
    new = KVCache(cache.k.at[:, :, slots].set(heads(k[:, T - n:])), cache.v.at[:, :, slots].set(heads(v[:, T - n:])),
                  cache.kpos.at[slots].set(positions[T - n:]), cache.pos + T)
    if T == 1:
      # Decoding: write first and attend over the cache in place (no copy of every layer's K/V per token).
      # The slot overwritten held position p - L, outside the window (L = window) or never filled (L = max_len).
      kk, vv, kpos = new.k, new.v, new.kpos
    else:
      kk = jnp.concatenate([cache.k, heads(k)], axis=2)
      vv = jnp.concatenate([cache.v, heads(v)], axis=2)
      kpos = jnp.concatenate([cache.kpos, positions])  # [S]
    # A window of at most L: what a decode step sees (the ring's L slots) is what a prefill piece's queries see,
    # so the logits do not depend on how a prompt longer than the cache is cut into pieces.
    span = min(self.window, L) if self.window else L
    ok = (kpos[None, :] >= 0) & (kpos[None, :] <= positions[:, None]) & (positions[:, None] - kpos[None, :] < span)
    # XLA: the ring's positions need a dense mask, which cuDNN's fused kernel does not take.
    o = jax.nn.dot_product_attention(q.astype(kk.dtype), jnp.swapaxes(kk, 1, 2), jnp.swapaxes(vv, 1, 2),
                                     mask=ok[None, None])
    return o.astype(q.dtype), new
