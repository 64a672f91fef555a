"""The delta-rule mixer family as one module: projections, short conv, gates and output norm around the op.

Shapes: B batch, T time (this device's slice under context parallelism), D d_model, H q/k heads, HV value heads,
K key dim, V value dim, W conv size, R rank.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from gdn import ops
from gdn.config import RecurrentConfig
from gdn.layers.conv import ShortConv
from gdn.layers.fused import fuse_projections, lean, project
from gdn.layers.norms import ACTIVATIONS, GatedRMSNorm, RMSNorm, l2norm
from gdn.layers.segments import check_mixer_call
from gdn.ops import pallas_decode
from gdn.ops.context_parallel import local_gated_delta_rule


# The projections of the layer's input x, which `fuse` turns into one matmul.
X_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "a_proj", "f_a_proj", "b_proj", "g_proj", "g_a_proj")


class RecurrentCache(NamedTuple):
  conv: Optional[jax.Array]  # [B, W-1, 2*H*K + HV*V] last inputs of the short conv (None without it)
  S: jax.Array  # [B, HV, K, V] float32


def init_decay(key, shape_A, shape_dt, dt_init: str, bounded: bool = False):
  """(A_log, dt_bias) for g = -exp(A_log) * softplus(a + dt_bias).

  "fla": dt = log-uniform in [1e-3, 0.1] (floored at 1e-4), dt_bias = softplus^-1(dt), A ~ U(1, 16); with
  `bounded` (the gate LB * sigmoid(exp(A_log) * (a + dt_bias))) A = 1, as fla's KDA layer with safe_gate.
  "seed": dt_bias = 1, A ~ U(0, 16).
  """
  k_A, k_dt = jax.random.split(key)
  if dt_init == "seed":
    # U(0, 16) can return exactly 0; the floor only keeps log finite for that 1-in-2^23 draw.
    A = jnp.maximum(jax.random.uniform(k_A, shape_A, jnp.float32, 0.0, 16.0), 1e-30)
    return jnp.log(A), jnp.ones(shape_dt, jnp.float32)
  A = jnp.ones(shape_A, jnp.float32) if bounded else jax.random.uniform(k_A, shape_A, jnp.float32, 1.0, 16.0)
  lo, hi = math.log(1e-3), math.log(0.1)
  dt = jnp.maximum(jnp.exp(jax.random.uniform(k_dt, shape_dt, jnp.float32, lo, hi)), 1e-4)
  return jnp.log(A), dt + jnp.log(-jnp.expm1(-dt))


class RecurrentMixer(nnx.Module):
  """Gated DeltaNet and its baselines, chosen by the switches of `RecurrentConfig`:

    q, k, v = SiLU(conv(W_q x, W_k x, W_v x))     (conv with a bias if conv_bias; without short_conv, plain
                                                   projections, or SiLU of them with silu_without_conv)
    q, k    = l2norm(q) / sqrt(K), l2norm(k)       (qk_norm "l2")
    g       = -exp(A_log) * softplus(W_a x + dt_bias)     per head [B,T,HV], or per key channel [B,T,HV,K]
                                                          through a rank-R projection (KDA)
    v       = softplus(W_a x + dt_bias) * v               with write_scale "dt" (Mamba2's discretised input)
    beta    = sigmoid(W_b x) (x2 with allow_neg_eigval)    per head [B,T,HV] or per value channel [B,T,HV,V]
    o       = gated_delta_rule(q, k, v, g, beta)
    y       = W_o dropout(RMSNorm(o) * act(W_g x))    W_g x is W_g2 (W_g1 x) + b_g with output_gate_rank

  The seed preset is the seed text's `GatedDeltaNet` exactly (q is divided by sqrt(K) before the op, which
  then runs with scale 1). The KDA preset's output gate is full rank; output_gate_rank=V gives fla's two-layer
  one. KDA's per-channel dt_bias gets the same log-uniform init as the per-head one. Initialisation: projections
  normal(init_std), the output projection normal(out_init_std); norms one; biases zero; A_log and dt_bias as
  `init_decay`.
  """

  def __init__(self, cfg: RecurrentConfig, d_model: int, *, init_std: float = 0.02, out_init_std=None,
               dtype=jnp.float32, rngs: nnx.Rngs):
    if not isinstance(cfg, RecurrentConfig):
      raise TypeError(f"cfg must be a RecurrentConfig, got {type(cfg).__name__}")
    self.cfg = cfg
    self.d_model = d_model
    self.dtype = dtype
    H, HV, K, V = cfg.num_heads, cfg.HV, cfg.head_dim, cfg.V
    init = nnx.initializers.normal(init_std)

    def linear(n_in, n_out, bias=False, kernel_init=init):
      return nnx.Linear(n_in, n_out, use_bias=bias, kernel_init=kernel_init, dtype=dtype, rngs=rngs)

    self.q_proj = linear(d_model, H * K, cfg.qkv_bias)
    self.k_proj = linear(d_model, H * K, cfg.qkv_bias)
    self.v_proj = linear(d_model, HV * V, cfg.qkv_bias)
    # One depthwise conv over [q | k | v] channels is three separate ones, with one state to carry.
    self.conv = (ShortConv(2 * H * K + HV * V, cfg.conv_size, bias=cfg.conv_bias, init_std=init_std, dtype=dtype,
                           rngs=rngs) if cfg.short_conv else None)
    # Each attribute is assigned once (a module or None): NNX fixes an attribute's data/static status on first set.
    head, channel = cfg.decay == "head", cfg.decay == "channel"
    self.a_proj = linear(d_model, HV) if head else None
    self.f_a_proj = linear(d_model, cfg.decay_low_rank) if channel else None
    self.f_b_proj = linear(cfg.decay_low_rank, HV * K) if channel else None
    if cfg.decay != "none":
      A_log, dt_bias = init_decay(rngs.params(), (HV,), (HV,) if head else (HV * K,), cfg.dt_init,
                                  bounded=cfg.gate_lower_bound is not None)
      self.A_log, self.dt_bias = nnx.Param(A_log), nnx.Param(dt_bias)
    else:
      self.A_log = self.dt_bias = None
    self.b_proj = (linear(d_model, HV if cfg.beta == "head" else HV * V) if cfg.beta != "none" else None)
    gated, rank = cfg.output_gate != "none", cfg.output_gate_rank
    self.g_proj = linear(d_model, HV * V) if gated and rank is None else None
    # fla's KDA gate: two layers through rank R, a bias on the second only.
    self.g_a_proj = linear(d_model, rank) if gated and rank is not None else None
    self.g_b_proj = linear(rank, HV * V, bias=True) if gated and rank is not None else None
    if not cfg.output_norm:
      self.o_norm = None
    elif cfg.output_gate != "none":
      self.o_norm = GatedRMSNorm(V, eps=cfg.norm_eps, activation=cfg.output_gate)
    else:
      self.o_norm = RMSNorm(V, eps=cfg.norm_eps)
    out_init = nnx.initializers.normal(init_std if out_init_std is None else out_init_std)
    self.o_proj = linear(HV * V, d_model, cfg.out_bias, out_init)
    self.dropout = nnx.Dropout(cfg.dropout, rngs=rngs)
    self.in_proj = None  # the X_PROJECTIONS as one FusedLinear, after `fuse` (inference)

  def fuse(self):
    """In place, for inference: the projections of x become one matmul (`gdn.layers.fused.fuse_projections`),
    the output projection a `LeanLinear` (the same matmul, with the inference path's handling of one row)."""
    fuse_projections(self, X_PROJECTIONS)
    self.o_proj = lean(self.o_proj)

  def init_cache(self, batch: int, max_len: int = 0) -> RecurrentCache:
    """An empty cache; max_len is unused (the state does not grow) and kept for a uniform layer interface."""
    cfg = self.cfg
    conv = self.conv.init_state(batch) if self.conv is not None else None
    return RecurrentCache(conv, jnp.zeros((batch, cfg.HV, cfg.head_dim, cfg.V), jnp.float32))

  def __call__(self, x, *, segment_ids=None, cache: Optional[RecurrentCache] = None, context_axis=None):
    """x [B, T, D] -> (y [B, T, D], new cache or None).

    With a cache, T == 1 runs `gated_delta_rule_step` (decoding); T > 1 runs the sequence op from the cached
    state (prefill, possibly in pieces). segment_ids [B, T] restart the state (training on packed data).
    context_axis: None, or the name of a mesh axis over which the sequence is split (inside a `shard_map`):
    x and segment_ids are this device's slice; the op runs as `local_gated_delta_rule` and the short conv
    takes the previous device's last inputs.
    """
    cfg = self.cfg
    check_mixer_call(x, self.d_model, segment_ids, cache)
    if context_axis is not None and cache is not None:
      raise ValueError("a recurrent cache cannot be combined with context_axis: decoding runs on one device")
    B, T, _ = x.shape
    layout = self._decode_layout(cache, T, segment_ids)
    if layout is not None:
      o, conv_state, S = self._decode_fused(self.in_proj.matmul(x[:, 0]), cache, layout)
    else:
      with jax.named_scope("projections"):
        p = project(self, X_PROJECTIONS, x)
      mix = functools.partial(self._mix, B=B, T=T, segment_ids=segment_ids, cache=cache, context_axis=context_axis)
      if cfg.remat == "layer" and cache is None:
        # Only the projections (this function's inputs) are kept; the rest runs again in the backward.
        mix = jax.checkpoint(mix, policy=jax.checkpoint_policies.nothing_saveable)
      o, conv_state, S = mix(p)
    o = o.reshape(B, T, cfg.HV * cfg.V).astype(x.dtype)
    # Inference (a cache) never drops out, so decoding needs no rng and a training-mode model decodes too.
    o = self.dropout(o, deterministic=True) if cache is not None else self.dropout(o)
    with jax.named_scope("o_proj"):
      y = self.o_proj(o)
    return y, (None if cache is None else RecurrentCache(conv_state, S))

  def _decode_layout(self, cache, T, segment_ids) -> Optional[pallas_decode.Layout]:
    """The fused decode kernel's layout where it runs this call, else None (the XLA path): a decode step (T == 1
    with a cache) of a fused layer (`fuse`) of the Gated DeltaNet variant (short conv, l2 q/k norm, per-head
    decay and beta, full-rank SiLU gate into the gated RMSNorm; GVA and allow_neg_eigval allowed) in 16/32-bit
    floats, with `pallas_decode.enabled` for its batch and shapes the kernel takes. Read at trace time."""
    cfg = self.cfg
    if (cache is None or T != 1 or segment_ids is not None or self.in_proj is None
        or not pallas_decode.enabled(cache.S.shape[0])):
      return None
    offsets = self.in_proj.offsets()
    if (tuple(offsets) != ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj") or self.conv is None
        or cache.conv is None or cfg.decay != "head" or cfg.beta != "head" or cfg.qk_norm != "l2"
        or cfg.gate_lower_bound is not None  # the kernel computes the softplus gate
        or cfg.write_scale != "none"  # and writes v unscaled
        or not isinstance(self.o_norm, GatedRMSNorm) or self.o_norm.activation != "silu"
        or jnp.dtype(self.dtype).itemsize > 4):
      return None
    layout = pallas_decode.Layout(H=cfg.num_heads, HV=cfg.HV, K=cfg.head_dim, V=cfg.V, a=offsets["a_proj"][0],
                                  b=offsets["b_proj"][0], gate=offsets["g_proj"][0], eps=self.o_norm.eps,
                                  allow_neg_eigval=cfg.allow_neg_eigval)
    return layout if pallas_decode.supports(layout, self.conv.size) else None

  def _decode_fused(self, y, cache: RecurrentCache, layout):
    """`_mix`'s results for one token through the fused decode kernel, from the fused projection's row y [B, N]."""
    conv = self.conv
    o, S, window = pallas_decode.fused_step(
        y, cache.conv, conv.weight[...].astype(y.dtype), None if conv.bias is None else conv.bias[...].astype(y.dtype),
        self.A_log[...], self.dt_bias[...], cache.S, self.o_norm.weight[...], layout=layout)
    return o[:, None], window, S

  def _mix(self, p, *, B, T, segment_ids, cache, context_axis):
    """From the projections p of x to the normed, gated op output o [B, T, HV, V]: (o, conv state, S)."""
    cfg = self.cfg
    HV, V = cfg.HV, cfg.V
    features = functools.partial(self._features, B=B, T=T, segment_ids=segment_ids, cache=cache,
                                 context_axis=context_axis)
    if cfg.remat == "features" and cache is None:
      # Only the projections of x for q, k, v are kept; the short conv, its SiLU and the q/k norm run again in
      # the backward. Their outputs are still kept where the op keeps its inputs.
      features = jax.checkpoint(features, policy=jax.checkpoint_policies.nothing_saveable)
    q, k, v, conv_state = features(p["q_proj"], p["k_proj"], p["v_proj"])

    with jax.named_scope("gates"):
      g = self.log_decay(p, B, T)
      beta = None
      if cfg.beta != "none":
        beta = jax.nn.sigmoid(p["b_proj"].astype(jnp.float32))
        if cfg.allow_neg_eigval:
          beta = 2.0 * beta
        beta = beta.reshape((B, T, HV) if cfg.beta == "head" else (B, T, HV, V))
      if cfg.write_scale == "dt":
        v = (v.astype(jnp.float32) * self.step_size(p)[..., None]).astype(v.dtype)

    S0 = None if cache is None else cache.S
    if cache is not None and T == 1:
      at0 = lambda a: None if a is None else a[:, 0]
      o, S = ops.gated_delta_rule_step(q[:, 0], k[:, 0], v[:, 0], at0(g), at0(beta), state=S0, scale=1.0)
      o = o[:, None]
    else:
      if context_axis is not None:
        # The token scan has no slice map: "auto" and "recurrent" run the chunk form across devices.
        method = cfg.method if cfg.method in ("chunk", "associative") else "chunk"
        op = functools.partial(local_gated_delta_rule, axis_name=context_axis, scale=1.0, segment_ids=segment_ids,
                               method=method, chunk_size=cfg.chunk_size, g_lower_bound=cfg.gate_lower_bound)
      else:
        op = functools.partial(ops.gated_delta_rule, scale=1.0, initial_state=S0, segment_ids=segment_ids,
                               method=cfg.method, chunk_size=cfg.chunk_size, local_groups=cfg.local_groups,
                               g_lower_bound=cfg.gate_lower_bound)
      if cfg.remat == "op" and cache is None:
        # Only the op's inputs are kept; its chunk-local work and chunk states run again in the backward.
        op = jax.checkpoint(op, policy=jax.checkpoint_policies.nothing_saveable)
      o, S = op(q, k, v, g, beta)

    with jax.named_scope("out_norm"):
      gate = self._output_gate(p)
      gate = None if gate is None else gate.reshape(B, T, HV, V)
      if isinstance(self.o_norm, GatedRMSNorm):
        o = self.o_norm(o, gate)
      else:
        if self.o_norm is not None:
          o = self.o_norm(o)
        if gate is not None:
          o = (o.astype(jnp.float32) * ACTIVATIONS[cfg.output_gate](gate.astype(jnp.float32))).astype(o.dtype)
    return o, conv_state, S

  def _features(self, q, k, v, *, B, T, segment_ids, cache, context_axis):
    """The op's q [B, T, H, K] (normed, scaled by K^-1/2), k [B, T, H, K] and v [B, T, HV, V] from the
    projections of x, through the short conv and its SiLU (or the SiLU alone) and the q/k norm; and the conv's
    state (None without a conv)."""
    cfg = self.cfg
    H, HV, K, V = cfg.num_heads, cfg.HV, cfg.head_dim, cfg.V
    conv_state = None
    if self.conv is not None:
      with jax.named_scope("short_conv"):
        (q, k, v), conv_state = self.conv((q, k, v), segment_ids=segment_ids,
                                          state=None if cache is None else cache.conv, context_axis=context_axis,
                                          activation="silu")
    elif cfg.silu_without_conv:
      q, k, v = jax.nn.silu(q), jax.nn.silu(k), jax.nn.silu(v)
    q, k, v = q.reshape(B, T, H, K), k.reshape(B, T, H, K), v.reshape(B, T, HV, V)
    with jax.named_scope("qk_norm"):
      if cfg.qk_norm == "l2":
        q, k = l2norm(q), l2norm(k)
      # Divided here, as the seed does, so the op runs with scale 1 and the seed preset is reproduced exactly.
      q = q / math.sqrt(K)
    return q, k, v, conv_state

  def _output_gate(self, p):
    """The output gate's pre-activation [B, T, HV*V] from the projections p of x, full rank or through
    output_gate_rank; None without a gate."""
    if "g_proj" in p:
      return p["g_proj"]
    if "g_a_proj" in p:
      return self.g_b_proj(p["g_a_proj"])
    return None

  def step_size(self, p):
    """dt = softplus(a + dt_bias) per head [B, T, HV] in float32 (decay "head"): the step of g = -exp(A_log) dt."""
    return jax.nn.softplus(p["a_proj"].astype(jnp.float32) + self.dt_bias[...])

  def log_decay(self, p, B, T):
    """g = -exp(A_log) * softplus(a + dt_bias), or with gate_lower_bound LB g = LB * sigmoid(exp(A_log) * (a +
    dt_bias)) (fla's bounded KDA gate), in float32 from the projections p of x: [B, T, HV], [B, T, HV, K] or
    None."""
    cfg = self.cfg
    if cfg.decay == "none":
      return None
    A = jnp.exp(self.A_log[...])
    if cfg.decay == "head":
      a = p["a_proj"].astype(jnp.float32) + self.dt_bias[...]
    else:
      a = (self.f_b_proj(p["f_a_proj"]).astype(jnp.float32) + self.dt_bias[...]).reshape(B, T, cfg.HV, cfg.head_dim)
      A = A[:, None]
    if cfg.gate_lower_bound is not None:
      return cfg.gate_lower_bound * jax.nn.sigmoid(A * a)
    return -A * jax.nn.softplus(a)
