"""Import flash-linear-attention's `fla.layers.GatedDeltaNet` into `RecurrentMixer`.

fla's layer: q_proj / k_proj [H*K, D], v_proj [HV*V, D], a_proj / b_proj [HV, D], A_log and dt_bias [HV],
q_conv1d / k_conv1d / v_conv1d depthwise weights [C, 1, W] followed by SiLU, g_proj [HV*V, D] with
o_norm = FusedRMSNormGated(V) (or a plain RMSNorm(V) without the gate), o_proj [D, HV*V]; no biases.
Its kernel L2-normalises q and k (eps 1e-6), scales q by K^-0.5, takes beta = sigmoid(b) (x2 with
allow_neg_eigval) and g = -exp(A_log) * softplus(a + dt_bias): the paper preset of `RecurrentMixer`.
Value head i reads q/k head i // (HV // H) in both.
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdn.config import RecurrentConfig
from gdn.interop.state_dict import Tensors, assign, field, linear, target
from gdn.layers.recurrent import RecurrentMixer

LAYER_NORM_EPS = 1e-5  # fla.layers.GatedDeltaNet's default; its models pass config.norm_eps (1e-6 by default)
GATES = {"swish": "silu", "silu": "silu", "sigmoid": "sigmoid"}


def mixer_config(state_dict, *, prefix: str = "", fla_config=None, num_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, allow_neg_eigval: Optional[bool] = None,
                 norm_eps: Optional[float] = None, output_gate_activation: Optional[str] = None,
                 **overrides) -> tuple:
  """(RecurrentConfig, d_model) of the fla layer whose weights are `state_dict` (a mapping or safetensors path).

  The weights show HV (A_log), V (o_norm), H*K (q_proj), W (conv), d_model, whether the gate and short conv are
  on. The rest comes from the keywords, else from `fla_config` (a `GatedDeltaNetConfig` or its config.json dict),
  else from the layer's defaults: num_heads or head_dim (one is needed), allow_neg_eigval (False), norm_eps (1e-5),
  output_gate_activation ("swish"). `overrides` set our fields that fla has no counterpart for (method, ...).
  """
  t = state_dict if isinstance(state_dict, Tensors) else Tensors(state_dict, prefix)

  def pick(value, name, default):
    if value is not None:
      return value
    return default if fla_config is None else field(fla_config, name, default)

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
  if "q_conv1d.bias" in t:
    raise ValueError("state_dict: the fla layer has conv_bias=True (q_conv1d.bias); RecurrentMixer's short "
                     "convolution has no bias")
  if "q_conv1d.weight" not in t:
    # Without its short conv, fla applies SiLU to q, k and v; RecurrentMixer applies none without the conv.
    raise ValueError("state_dict: the fla layer has use_short_conv=False (no q_conv1d.weight), whose SiLU on "
                     "q, k, v RecurrentMixer does not reproduce")
  gated = "g_proj.weight" in t
  cfg = RecurrentConfig(num_heads=H, num_v_heads=HV, head_dim=K, v_head_dim=V, decay="head", beta="head",
                        allow_neg_eigval=allow_neg_eigval, short_conv=True, conv_size=t.shape("q_conv1d.weight")[-1],
                        output_gate=GATES[activation] if gated else "none", output_norm=True, qk_norm="l2",
                        norm_eps=norm_eps, **overrides)
  return cfg, D


def mixer_params(state_dict, cfg: RecurrentConfig, d_model: int, *, prefix: str = "") -> dict:
  """Nested NumPy params of `RecurrentMixer(cfg, d_model)` from the fla layer's state_dict; every tensor is used."""
  t = state_dict if isinstance(state_dict, Tensors) else Tensors(state_dict, prefix)
  H, HV, K, V, W, D = cfg.num_heads, cfg.HV, cfg.head_dim, cfg.V, cfg.conv_size, d_model
  # Our one conv runs over the concatenated [q | k | v] channels with weight [W, C]; fla's are [C, 1, W] each.
  conv = np.concatenate([t.take(f"{n}_conv1d.weight", (c, 1, W))[:, 0, :]
                         for n, c in (("q", H * K), ("k", H * K), ("v", HV * V))], axis=0).T
  p = {
      "q_proj": linear(t, "q_proj", D, H * K),
      "k_proj": linear(t, "k_proj", D, H * K),
      "v_proj": linear(t, "v_proj", D, HV * V),
      "conv": {"weight": conv},
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
  """A `RecurrentMixer` holding the fla layer's weights (filled in place when `module` is given).

  state_dict: the layer's `state_dict()`, any mapping of names to tensors, or a safetensors path; prefix selects
  one layer of a model checkpoint (e.g. "model.layers.0.attn."). `config`: `mixer_config`'s keywords.
  """
  t = Tensors(state_dict, prefix)
  cfg, d_model = mixer_config(t, **config)
  module = target(module, lambda: RecurrentMixer(cfg, d_model, dtype=dtype, rngs=rngs or nnx.Rngs(0)), cfg, d_model)
  return assign(module, mixer_params(t, cfg, d_model))
