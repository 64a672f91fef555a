"""Import the seed text's PyTorch `GatedDeltaNet` (section 6.6.4) into `RecurrentMixer` with the "seed" preset.

The seed class: W_query / W_key / W_value (bias if qkv_bias), W_gate and W_beta [d_out, d_in], W_alpha
[num_heads, d_in], dt_bias and A_log [num_heads], norm = nn.RMSNorm(head_dim, eps=1e-6), out_proj (with bias).
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
from flax import nnx

from gdn.config import RecurrentConfig, recurrent_preset
from gdn.interop.state_dict import Tensors, assign, linear, target
from gdn.layers.recurrent import RecurrentMixer

NORM_EPS = 1e-6  # the class hard-codes nn.RMSNorm(head_dim, eps=1e-6)


def mixer_config(state_dict, *, prefix: str = "", dropout: float = 0.0, **overrides) -> tuple:
  """(RecurrentConfig, d_model) of the seed class whose weights are `state_dict` (a mapping or a safetensors path).

  num_heads comes from A_log, head_dim from W_query, qkv_bias from whether W_query.bias is present. `overrides`
  set fields that no weight shows (method, chunk_size).
  """
  t = state_dict if isinstance(state_dict, Tensors) else Tensors(state_dict, prefix)
  (H,) = t.shape("A_log")
  d_out, d_in = t.shape("W_query.weight")
  if d_out % H:
    raise ValueError(f"state_dict: W_query.weight has {d_out} rows, not a multiple of num_heads={H} (from A_log)")
  if d_in != d_out:
    # The class maps d_in -> d_out and its out_proj d_out -> d_out; our mixer returns to the residual width.
    raise ValueError(f"state_dict: the seed layer has d_in={d_in} != d_out={d_out}; RecurrentMixer maps d_model "
                     f"back to d_model, so only d_in == d_out imports")
  cfg = recurrent_preset("seed", num_heads=H, head_dim=d_out // H, qkv_bias="W_query.bias" in t,
                         dropout=dropout, norm_eps=NORM_EPS, **overrides)
  return cfg, d_in


def mixer_params(state_dict, cfg: RecurrentConfig, d_model: int, *, prefix: str = "") -> dict:
  """Nested NumPy params of `RecurrentMixer(cfg, d_model)` from the seed class's state_dict; every tensor is used."""
  t = state_dict if isinstance(state_dict, Tensors) else Tensors(state_dict, prefix)
  H, K = cfg.num_heads, cfg.head_dim
  D, HK = d_model, cfg.num_heads * cfg.head_dim
  p = {
      "q_proj": linear(t, "W_query", D, HK, bias=cfg.qkv_bias),
      "k_proj": linear(t, "W_key", D, HK, bias=cfg.qkv_bias),
      "v_proj": linear(t, "W_value", D, HK, bias=cfg.qkv_bias),
      "g_proj": linear(t, "W_gate", D, HK),
      "b_proj": linear(t, "W_beta", D, HK),
      "a_proj": linear(t, "W_alpha", D, H),
      "dt_bias": t.take("dt_bias", (H,)),
      "A_log": t.take("A_log", (H,)),
      "o_norm": {"weight": t.take("norm.weight", (K,))},
      "o_proj": linear(t, "out_proj", HK, D, bias=True),
  }
  t.check_consumed()
  return p


def load_mixer(state_dict, *, prefix: str = "", module: Optional[RecurrentMixer] = None, dtype=jnp.float32,
               rngs: Optional[nnx.Rngs] = None, **config) -> RecurrentMixer:
  """A `RecurrentMixer` holding the seed layer's weights (filled in place when `module` is given).

  state_dict: the torch module's `state_dict()`, any mapping of names to tensors, or a safetensors path; prefix
  selects one layer of a larger checkpoint. `config`: `mixer_config`'s keywords (dropout, method, chunk_size).
  """
  t = Tensors(state_dict, prefix)
  cfg, d_model = mixer_config(t, **config)
  module = target(module, lambda: RecurrentMixer(cfg, d_model, dtype=dtype, rngs=rngs or nnx.Rngs(0)), cfg, d_model)
  return assign(module, mixer_params(t, cfg, d_model))
