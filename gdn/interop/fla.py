"""Import flash-linear-attention's `fla.layers.GatedDeltaNet` and `fla.layers.KimiDeltaAttention` into
`RecurrentMixer`.

Both layers: q_proj / k_proj [H*K, D], v_proj [HV*V, D], b_proj [HV, D], A_log [HV], o_norm over V, o_proj
[D, HV*V], no projection biases. With use_short_conv, q_conv1d / k_conv1d / v_conv1d are depthwise [C, 1, W]
weights (and [C] biases with conv_bias=True) followed by SiLU; without it, fla takes SiLU of the projections.
Their kernels L2-normalise q and k (eps 1e-6), scale q by K^-0.5, take beta = sigmoid(b) (x2 with
allow_neg_eigval), and value head i reads q/k head i // (HV // H), as ours.

GatedDeltaNet: a_proj [HV, D], dt_bias [HV], g = -exp(A_log) * softplus(a + dt_bias) per head; g_proj [HV*V, D]
with o_norm = FusedRMSNormGated(V) (swish or sigmoid), or a plain RMSNorm(V) without the gate: the paper preset.
KimiDeltaAttention: f_proj = Linear(D, V) then Linear(V, HV*K), dt_bias [HV*K], g = -exp(A_log) * softplus(f +
dt_bias) per key channel (decay "channel", decay_low_rank V); g_proj = Linear(D, V) then Linear(V, HV*V) with a
bias (output_gate_rank V), o_norm = FusedRMSNormGated(V, activation="sigmoid"): the kda preset.
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdn.config import RecurrentConfig
from gdn.interop.state_dict import Tensors, assign, field, linear, target
from gdn.layers.recurrent import RecurrentMixer

LAYER_NORM_EPS = 1e-5  # the fla layers' default; fla's models pass config.norm_eps (1e-6 by default)
GATES = {"swish": "silu", "silu": "silu", "sigmoid": "sigmoid"}


def _picker(fla_config):
  """pick(value, name, default): the keyword if given, else `fla_config`'s field, else the layer's default."""
  def pick(value, name, default):
    if value is not None:
      return value
    return default if fla_config is None else field(fla_config, name, default)
  return pick


def _short_conv(t: Tensors) -> dict:
  """Our short-conv fields from the weights: the conv and its bias if present, else fla's SiLU without it."""
  if "q_conv1d.weight" not in t:
    return dict(short_conv=False, silu_without_conv=True)
  return dict(short_conv=True, conv_size=t.shape("q_conv1d.weight")[-1], conv_bias="q_conv1d.bias" in t)


def _short_conv_params(t: Tensors, cfg: RecurrentConfig) -> dict:
  """Our one conv over the concatenated [q | k | v] channels (weight [W, C], bias [C]) from fla's three."""
  if not cfg.short_conv:
    return {}
  H, HV, K, V, W = cfg.num_heads, cfg.HV, cfg.head_dim, cfg.V, cfg.conv_size
  channels = (("q", H * K), ("k", H * K), ("v", HV * V))
  conv = {"weight": np.concatenate([t.take(f"{n}_conv1d.weight", (c, 1, W))[:, 0, :] for n, c in channels], 0).T}
  if cfg.conv_bias:
    conv["bias"] = np.concatenate([t.take(f"{n}_conv1d.bias", (c,)) for n, c in channels])
  return {"conv": conv}


def mixer_config(state_dict, *, prefix: str = "", fla_config=None, num_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, allow_neg_eigval: Optional[bool] = None,
                 norm_eps: Optional[float] = None, output_gate_activation: Optional[str] = None,
                 **overrides) -> tuple:
  """(RecurrentConfig, d_model) of the fla GatedDeltaNet whose weights are `state_dict` (a mapping or safetensors
  path).

  The weights show HV (A_log), V (o_norm), H*K (q_proj), d_model, whether the gate and short conv are on, and the
  conv's W and bias. The rest comes from the keywords, else from `fla_config` (a `GatedDeltaNetConfig` or its
  config.json dict), else from the layer's defaults: num_heads or head_dim (one is needed), allow_neg_eigval
  (False), norm_eps (1e-5), output_gate_activation ("swish"). `overrides` set our fields that fla has no
  counterpart for (method, ...).
  """
  t = state_dict if isinstance(state_dict, Tensors) else Tensors(state_dict, prefix)
  pick = _picker(fla_config)
  num_heads, head_dim = pick(num_heads, "num_heads", None), pick(head_dim, "head_dim", None)
  allow_neg_eigval = bool(pick(allow_neg_eigval, "allow_neg_eigval", False))
  norm_eps = float(pick(norm_eps, "norm_eps", LAYER_NORM_EPS))
  activation = pick(output_gate_activation, "output_gate_activation", "swish")
  if activation not in GATES:
    raise ValueError(f"output_gate_activation must be one of {tuple(GATES)}, got {activation!r}")

  (HV,) = t.shape("A_log")
  (V,) = t.shape("o_norm.weight")
  HK, D = t.shape("q_proj.weight")
  if num_heads is None and head_dim is None:
    raise ValueError("num_heads or head_dim is needed (the weights only show num_heads * head_dim = "
                     f"{HK}): pass it, or fla_config")
  H = num_heads if num_heads is not None else HK // head_dim
  K = head_dim if head_dim is not None else HK // num_heads
  if H * K != HK:
    raise ValueError(f"num_heads={num_heads} and head_dim={head_dim} do not match q_proj.weight's {HK} rows")
  gated = "g_proj.weight" in t
  cfg = RecurrentConfig(num_heads=H, num_v_heads=HV, head_dim=K, v_head_dim=V, decay="head", beta="head",
                        allow_neg_eigval=allow_neg_eigval, **_short_conv(t),
                        output_gate=GATES[activation] if gated else "none", output_norm=True, qk_norm="l2",
                        norm_eps=norm_eps, **overrides)
  return cfg, D


def mixer_params(state_dict, cfg: RecurrentConfig, d_model: int, *, prefix: str = "") -> dict:
  """Nested NumPy params of `RecurrentMixer(cfg, d_model)` from the fla GatedDeltaNet's state_dict; every tensor
  is used."""
  t = state_dict if isinstance(state_dict, Tensors) else Tensors(state_dict, prefix)
  H, HV, K, V, D = cfg.num_heads, cfg.HV, cfg.head_dim, cfg.V, d_model
  p = {
      "q_proj": linear(t, "q_proj", D, H * K),
      "k_proj": linear(t, "k_proj", D, H * K),
      "v_proj": linear(t, "v_proj", D, HV * V),
      **_short_conv_params(t, cfg),
      "a_proj": linear(t, "a_proj", D, HV),
      "b_proj": linear(t, "b_proj", D, HV),
      "A_log": t.take("A_log", (HV,)),
      "dt_bias": t.take("dt_bias", (HV,)),
      "o_norm": {"weight": t.take("o_norm.weight", (V,))},
      "o_proj": linear(t, "o_proj", HV * V, D),
  }
  if cfg.output_gate != "none":
    p["g_proj"] = linear(t, "g_proj", D, HV * V)
  t.check_consumed()
  return p


def load_mixer(state_dict, *, prefix: str = "", module: Optional[RecurrentMixer] = None, dtype=jnp.float32,
               rngs: Optional[nnx.Rngs] = None, **config) -> RecurrentMixer:
  """A `RecurrentMixer` holding the fla GatedDeltaNet's weights (filled in place when `module` is given).

  state_dict: the layer's `state_dict()`, any mapping of names to tensors, or a safetensors path; prefix selects
  one layer of a model checkpoint (e.g. "model.layers.0.attn."). `config`: `mixer_config`'s keywords.
  """
  t = Tensors(state_dict, prefix)
  cfg, d_model = mixer_config(t, **config)
  module = target(module, lambda: RecurrentMixer(cfg, d_model, dtype=dtype, rngs=rngs or nnx.Rngs(0)), cfg, d_model)
  return assign(module, mixer_params(t, cfg, d_model))


def kda_config(state_dict, *, prefix: str = "", fla_config=None, allow_neg_eigval: Optional[bool] = None,
               norm_eps: Optional[float] = None, lower_bound: Optional[float] = None, **overrides) -> tuple:
  """(RecurrentConfig, d_model) of the fla KimiDeltaAttention whose weights are `state_dict`.

  The weights show every size: HV (A_log), K (dt_bias holds HV*K), H (q_proj's H*K rows), V (o_norm), the ranks
  of f_proj and g_proj, d_model, the short conv. allow_neg_eigval (False), norm_eps (1e-5) and lower_bound (None)
  come from the keywords, else from `fla_config` (a `KDAConfig` or its config.json dict), else the layer's
  defaults. A lower_bound (fla's bounded gate lower_bound * sigmoid(exp(A_log) * (f + dt_bias))) is refused: our
  decay is -exp(A_log) * softplus(f + dt_bias). `overrides` set our fields that fla has no counterpart for.
  """
  t = state_dict if isinstance(state_dict, Tensors) else Tensors(state_dict, prefix)
  pick = _picker(fla_config)
  allow_neg_eigval = bool(pick(allow_neg_eigval, "allow_neg_eigval", False))
  norm_eps = float(pick(norm_eps, "norm_eps", LAYER_NORM_EPS))
  lower_bound = pick(lower_bound, "lower_bound", None)
  if lower_bound is not None:
    raise ValueError(f"lower_bound={lower_bound}: fla's bounded KDA gate lower_bound * sigmoid(exp(A_log) * "
                     f"(f + dt_bias)) is not our decay -exp(A_log) * softplus(f + dt_bias)")

  (HV,) = t.shape("A_log")
  (HVK,) = t.shape("dt_bias")
  (V,) = t.shape("o_norm.weight")
  HK, D = t.shape("q_proj.weight")
  if HVK % HV:
    raise ValueError(f"state_dict: dt_bias has {HVK} entries, not a multiple of num_v_heads={HV} (from A_log)")
  K = HVK // HV
  if HK % K:
    raise ValueError(f"state_dict: q_proj.weight has {HK} rows, not a multiple of head_dim={K} (dt_bias / A_log)")
  cfg = RecurrentConfig(num_heads=HK // K, num_v_heads=HV, head_dim=K, v_head_dim=V, decay="channel", beta="head",
                        allow_neg_eigval=allow_neg_eigval, **_short_conv(t),
                        decay_low_rank=t.shape("f_proj.0.weight")[0], output_gate="sigmoid",
                        output_gate_rank=t.shape("g_proj.0.weight")[0], output_norm=True, qk_norm="l2",
                        norm_eps=norm_eps, **overrides)
  return cfg, D


def kda_params(state_dict, cfg: RecurrentConfig, d_model: int, *, prefix: str = "") -> dict:
  """Nested NumPy params of `RecurrentMixer(cfg, d_model)` from the fla KimiDeltaAttention's state_dict; every
  tensor is used."""
  t = state_dict if isinstance(state_dict, Tensors) else Tensors(state_dict, prefix)
  H, HV, K, V, D = cfg.num_heads, cfg.HV, cfg.head_dim, cfg.V, d_model
  Rf, Rg = cfg.decay_low_rank, cfg.output_gate_rank
  p = {
      "q_proj": linear(t, "q_proj", D, H * K),
      "k_proj": linear(t, "k_proj", D, H * K),
      "v_proj": linear(t, "v_proj", D, HV * V),
      **_short_conv_params(t, cfg),
      # fla's dt_bias.view(HV, K) and f.view(..., HV, K) are our [HV * K] layout, value-head major.
      "f_a_proj": linear(t, "f_proj.0", D, Rf),
      "f_b_proj": linear(t, "f_proj.1", Rf, HV * K),
      "b_proj": linear(t, "b_proj", D, HV),
      "A_log": t.take("A_log", (HV,)),
      "dt_bias": t.take("dt_bias", (HV * K,)),
      "g_a_proj": linear(t, "g_proj.0", D, Rg),
      "g_b_proj": linear(t, "g_proj.1", Rg, HV * V, bias=True),
      "o_norm": {"weight": t.take("o_norm.weight", (V,))},
      "o_proj": linear(t, "o_proj", HV * V, D),
  }
  t.check_consumed()
  return p


def load_kda(state_dict, *, prefix: str = "", module: Optional[RecurrentMixer] = None, dtype=jnp.float32,
             rngs: Optional[nnx.Rngs] = None, **config) -> RecurrentMixer:
  """A `RecurrentMixer` holding the fla KimiDeltaAttention's weights (filled in place when `module` is given).

  state_dict: as `load_mixer`; prefix e.g. "model.layers.0.attn.". `config`: `kda_config`'s keywords.
  """
  t = Tensors(state_dict, prefix)
  cfg, d_model = kda_config(t, **config)
  module = target(module, lambda: RecurrentMixer(cfg, d_model, dtype=dtype, rngs=rngs or nnx.Rngs(0)), cfg, d_model)
  return assign(module, kda_params(t, cfg, d_model))
