"""Causal depthwise short convolution with a decoding state.

Shapes: B batch, T time (this device's slice under context parallelism), C channels, W kernel size.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdn.layers import conv_kernel
from gdn.layers.segments import segment_index

# The conv's backward from its own VJP (`causal_conv`): it keeps only the padded input, the weight and the segment
# mask, and recomputes the taps (and the SiLU's input) in the backward. False: JAX's autodiff of the taps, which
# keeps every shifted slice of the input and the pre-activation as residuals. Off: on an H200 (one layer, 8 x 8192
# tokens, d_model 2048) XLA:GPU's autodiff program already peaks no higher (9.60 GiB both) and runs 4% faster
# (docs/benchmarks.md, "What the layer's backward keeps"). Since then its backward writes the pre-activation's
# cotangent once (an optimization barrier) instead of letting XLA recompute it in each reader; timed on the H200
# since, it is still no faster: the conv's fwd+bwd 1.67 against 1.48 ms at (8, 4096, 6144), the 340M training step
# 489.5 against 484.3 ms (`experiments/bench_conv.py --switch layers.conv.CONV_VJP=off,on`, docs/benchmarks.md).
CONV_VJP = False
# The taps as one depthwise `lax.conv_general_dilated` (feature_group_count = C, no segments: a segment mask per
# tap and position is not a convolution): XLA:GPU lowers it and its two gradient convolutions to cuDNN kernels,
# in place of the shifted slices, pads and column reductions of the taps' autodiff. Off: on the H200 in bfloat16
# it is 14x slower than the taps (fwd+bwd 20.98 against 1.48 ms at (8, 4096, 6144); the 340M training step
# 1006.6 against 484.3 ms; docs/benchmarks.md). Read at trace time; CONV_VJP, where on, takes precedence.
CONV_LAX = False
# The conv and its SiLU as Pallas kernels (`gdn.layers.conv_kernel`): one pass over x forward and two backward,
# float32 arithmetic, no shifted copies; a model's q, k and v convolved each in place (`ShortConv` given the parts)
# so that their concatenation is never written. Shapes the kernels decline (T or C not a multiple of a block) keep
# the other paths. Off: on the H200 no faster than the taps and the layer's peak unchanged (docs/benchmarks.md,
# "On the card neither switch pays"; `experiments/bench_conv.py --switch layers.conv.CONV_KERNEL=off,on`); on an
# H100 with 64-channel blocks (now the kernels' first choice) the conv alone took 0.87x the taps' time, the 340M
# step 544.2 against 546.6 ms, within its spread (results/benchmarks/h100_2026-12-07/model_340m_conv.txt).
# Read at trace time; takes precedence over CONV_VJP and CONV_LAX where on.
CONV_KERNEL = False


def _taps(xp, w, b, keep, T: int):
  """sum_j keep_j * xp[:, j:j+T] * w[j] (+ b), in xp's dtype, as `ShortConv` computes it."""
  y = jnp.zeros(xp.shape[:1] + (T,) + xp.shape[2:], xp.dtype)
  for j in range(w.shape[0]):
    tap = xp[:, j:j + T] * w[j]
    if keep is not None:
      tap = jnp.where(keep[..., j, None], tap, 0)
    y = y + tap
  return y if b is None else y + b


def _lax_taps(xp, w, b, T: int):
  """`_taps` without segments as one depthwise convolution: y[t, c] = sum_j xp[t + j, c] w[j, c] (+ b)."""
  C = xp.shape[-1]
  y = jax.lax.conv_general_dilated(xp, w[:, None, :], window_strides=(1,), padding="VALID",
                                   dimension_numbers=("NWC", "WIO", "NWC"), feature_group_count=C)
  assert y.shape[1] == T, (y.shape, T)
  return y if b is None else y + b


def _activate(y, activation):
  return jax.nn.silu(y) if activation == "silu" else y


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def causal_conv(xp, w, b, keep, T: int, activation=None):
  """activation(sum_j keep_j * xp[:, j:j+T] * w[j] + b) for the padded input xp [B, T+W-1, C], w [W, C] and b [C]
  (or None) in xp's dtype; keep: None or bool [B, T, W] (tap j reaches position t). Its VJP keeps xp, w, b and
  keep only. activation: None or "silu"."""
  return _activate(_taps(xp, w, b, keep, T), activation)


def _conv_fwd(xp, w, b, keep, T, activation):
  return causal_conv(xp, w, b, keep, T, activation), (xp, w, b, keep)


def _conv_bwd(T, activation, res, dy):
  xp, w, b, keep = res
  dt, W = xp.dtype, w.shape[0]
  f32 = jnp.promote_types(jnp.float32, dt)  # float32 arithmetic, float64 for float64 callers
  if activation == "silu":
    y = _taps(xp, w, b, keep, T).astype(f32)
    s = jax.nn.sigmoid(y)
    dy = dy.astype(f32) * s * (1 + y * (1 - s))
  dy = dy.astype(dt)  # the pre-activation's cotangent in the inputs' dtype, as autodiff of the taps has it
  # Written once: otherwise XLA fuses its recomputation (the taps, the SiLU's derivative) into each of its W
  # shifted readers and W weight sums, reading the input W times per reader.
  dy = jax.lax.optimization_barrier(dy)
  taps = [dy if keep is None else jnp.where(keep[..., j, None], dy, 0) for j in range(W)]
  # Tap j read xp[:, j:j+T]: its cotangent enters there. Padded shifts summed in one expression (no scatter).
  dxp = sum(jnp.pad(d * w[j], ((0, 0), (j, W - 1 - j), (0, 0))) for j, d in enumerate(taps))
  # Per channel, sum over batch and time: a batched dot in the inputs' dtype accumulating in float32 (no float32
  # copies of the shifted inputs).
  dw = jnp.stack([jnp.einsum("btc,btc->c", d, xp[:, j:j + T], preferred_element_type=f32)
                  for j, d in enumerate(taps)])
  db = None if b is None else jnp.sum(dy.astype(f32), axis=(0, 1)).astype(b.dtype)
  dkeep = None if keep is None else np.zeros(keep.shape, jax.dtypes.float0)
  return dxp.astype(dt), dw.astype(w.dtype), db, dkeep


causal_conv.defvjp(_conv_fwd, _conv_bwd)


class ShortConv(nnx.Module):
  """y_t = sum_j w[j] * x_{t-W+1+j} (+ b) per channel (w[W-1] weighs the current token), no activation.

  The weight [W, C] is torch's Conv1d(C, C, W, groups=C) weight [C, 1, W] transposed, the optional bias [C] its
  bias. The state carries the last W-1 inputs [B, W-1, C] (inputs, not outputs, so the bias is not in it), so
  decoding a token at a time or prefilling in pieces equals one full pass.
  """

  def __init__(self, channels: int, size: int, *, bias: bool = False, init_std: float = 0.02, dtype=jnp.float32,
               rngs: nnx.Rngs):
    if size < 1:
      raise ValueError(f"size must be a positive int, got {size!r}")
    self.channels = channels
    self.size = size
    self.dtype = dtype
    self.weight = nnx.Param(nnx.initializers.normal(init_std)(rngs.params(), (size, channels), jnp.float32))
    self.bias = nnx.Param(jnp.zeros((channels,), jnp.float32)) if bias else None

  def init_state(self, batch: int, dtype=None):
    return jnp.zeros((batch, self.size - 1, self.channels), dtype or self.dtype)

  def __call__(self, x, *, segment_ids=None, state=None, context_axis=None, activation=None):
    """x [B, T, C]; segment_ids None or [B, T] (inputs of another segment do not reach a position);
    state None (zeros) or [B, W-1, C]. Returns (y [B, T, C], new state [B, W-1, C]); activation: None, or
    "silu" applied to y (inside the conv's own VJP with `CONV_VJP`, so that its input is not kept).

    x may also be a tuple of channel parts [B, T, C_i] whose concatenation is the input (a mixer's q, k, v):
    y is then the tuple of the outputs' parts. With `CONV_KERNEL` each part is convolved in place, so the
    concatenation is never written; otherwise the parts are joined and the output split, the same numbers.

    context_axis: None, or the name of a mesh axis over which the sequence is split (inside a `shard_map`):
    x and segment_ids are then this device's slice, and the last W-1 inputs of the previous device's slice
    take the state's place (zeros on the first device).
    """
    if isinstance(x, (tuple, list)):
      return self._parts(tuple(x), segment_ids=segment_ids, state=state, context_axis=context_axis,
                         activation=activation)
    if x.ndim != 3 or x.shape[-1] != self.channels:
      raise ValueError(f"x must be [B, T, C] with C={self.channels}, got shape {x.shape}")
    B, T, C = x.shape
    W = self.size
    if segment_ids is not None and segment_ids.shape != (B, T):
      raise ValueError(f"segment_ids must be [B, T] = {(B, T)}, got {segment_ids.shape}")
    if context_axis is not None:
      if state is not None:
        raise ValueError("a conv state cannot be combined with context_axis: the previous device's inputs "
                         "are the state")
      state, seg_before = _halo(x, segment_ids, W - 1, context_axis)
    elif state is None:
      state, seg_before = jnp.zeros((B, W - 1, C), x.dtype), None
    elif state.shape != (B, W - 1, C):
      raise ValueError(f"state must be [B, W-1, C] = {(B, W - 1, C)}, got {state.shape}")
    else:
      seg_before = None
    xp = jnp.concatenate([state.astype(x.dtype), x], axis=1)
    w = self.weight[...].astype(x.dtype)
    keep = _segment_keep(segment_ids, seg_before, W)
    b = None if self.bias is None else self.bias[...].astype(x.dtype)
    if activation not in (None, "silu"):
      raise ValueError(f"activation must be None or 'silu', got {activation!r}")
    if CONV_KERNEL and conv_kernel.supported(T, C, W):
      y = conv_kernel.short_conv(x, xp[:, :W - 1], w, b, keep, activation)
    elif CONV_VJP:
      y = causal_conv(xp, w, b, keep, T, activation)
    elif CONV_LAX and keep is None:
      y = _activate(_lax_taps(xp, w, b, T), activation)
    else:
      y = _activate(_taps(xp, w, b, keep, T), activation)
    return y, xp[:, T:]

  def _parts(self, xs, *, segment_ids, state, context_axis, activation):
    sizes = [p.shape[-1] if p.ndim == 3 else -1 for p in xs]
    if sum(sizes) != self.channels or min(sizes) < 1 or len({p.shape[:2] for p in xs}) != 1:
      raise ValueError(f"x's parts must be [B, T, C_i] with the C_i summing to C={self.channels}, got shapes "
                       f"{[p.shape for p in xs]}")
    B, T, _ = xs[0].shape
    W = self.size
    offsets = np.cumsum([0] + sizes)
    if (not CONV_KERNEL or context_axis is not None or T < W - 1
        or not all(conv_kernel.supported(T, c, W) for c in sizes)):
      y, new_state = self(jnp.concatenate(xs, axis=-1), segment_ids=segment_ids, state=state,
                          context_axis=context_axis, activation=activation)
      return tuple(y[..., a:z] for a, z in zip(offsets[:-1], offsets[1:])), new_state
    if state is not None and state.shape != (B, W - 1, self.channels):
      raise ValueError(f"state must be [B, W-1, C] = {(B, W - 1, self.channels)}, got {state.shape}")
    if segment_ids is not None and segment_ids.shape != (B, T):
      raise ValueError(f"segment_ids must be [B, T] = {(B, T)}, got {segment_ids.shape}")
    keep = _segment_keep(segment_ids, None, W)
    if activation not in (None, "silu"):
      raise ValueError(f"activation must be None or 'silu', got {activation!r}")
    dt = xs[0].dtype
    w = self.weight[...].astype(dt)
    b = None if self.bias is None else self.bias[...].astype(dt)
    ys, tails = [], []
    for p, a, z in zip(xs, offsets[:-1], offsets[1:]):
      st = jnp.zeros((B, W - 1, z - a), dt) if state is None else state[..., a:z].astype(dt)
      ys.append(conv_kernel.short_conv(p.astype(dt), st, w[:, a:z], None if b is None else b[a:z], keep,
                                       activation))
      tails.append(p[:, T - (W - 1):].astype(dt))
    return tuple(ys), jnp.concatenate(tails, axis=-1)


def _segment_keep(segment_ids, seg_before, W: int):
  """None without segments, else bool [B, T, W]: whether tap j's input (position t - (W-1-j)) is in t's segment."""
  if segment_ids is None:
    return None
  B, T = segment_ids.shape
  if seg_before is None:
    # A state prefix belongs to no segment: packed sequences start from a clean window.
    sp = jnp.concatenate([jnp.full((B, W - 1), -1, jnp.int32), segment_index(segment_ids)], axis=1)
  else:
    # The previous slice's ids continue this one's: segments are numbered over the joined window. On the
    # first device the prefix inputs are zeros, so whatever segment they are given adds nothing.
    sp = segment_index(jnp.concatenate([seg_before, segment_ids], axis=1))
  seg = sp[:, W - 1:]
  return jnp.stack([sp[:, j:j + T] == seg for j in range(W)], axis=-1)


def _halo(x, segment_ids, n: int, axis_name: str):
  """The last n steps of the previous device's slice along `axis_name`: x [B, T, C] -> [B, n, C] and
  segment_ids [B, T] -> [B, n] (None stays None); zeros on the first device, which has no predecessor."""
  B, T, C = x.shape
  if n == 0:
    return jnp.zeros((B, 0, C), x.dtype), None if segment_ids is None else segment_ids[:, :0]
  if T < n:
    raise ValueError(f"each device's slice must hold at least {n} steps (the conv size - 1) under context "
                     f"parallelism, got {T}")
  D = jax.lax.axis_size(axis_name)
  # ppermute sends device d's tail to d + 1; device 0 receives nothing, which ppermute fills with zeros.
  shift = lambda a: jax.lax.ppermute(a, axis_name, [(d, d + 1) for d in range(D - 1)])
  return shift(x[:, T - n:]), None if segment_ids is None else shift(segment_ids[:, T - n:])
