"""Parameter matching: the dense MLP width that brings a model to a target parameter count.

Ablations and hybrids change the mixer (a removed gate, attention in place of a recurrent layer, a second
recurrent kind), and with it the parameter count; compared at equal width, a model could win by size alone. The
dense SwiGLU's width is the one free knob that every block has: the count is linear in it (3 d_model x hidden per
dense layer), so one abstract init gives the width, rounded to a multiple of `multiple`.
"""

from __future__ import annotations

from gdn.bench.model_flops import param_count
from gdn.config import ModelConfig
from gdn.layers.mlp import hidden_size


def mlp_width(cfg: ModelConfig) -> int:
  return cfg.mlp_hidden or hidden_size(cfg.d_model, cfg.mlp_ratio)


def matched_mlp_hidden(cfg: ModelConfig, target: int, multiple: int = 8) -> int:
  """The dense MLP width (a multiple of `multiple`) whose model is closest to `target` parameters."""
  dense = cfg.mlp_kinds.count("dense")
  if not dense or not mlp_width(cfg):
    raise ValueError(f"matching needs dense MLP layers to widen: mlp_pattern={cfg.mlp_pattern!r}, "
                     f"mlp_ratio={cfg.mlp_ratio}, mlp_hidden={cfg.mlp_hidden}")
  h0 = mlp_width(cfg)
  per_unit = 3 * cfg.d_model * dense  # gate, up and down projections of every dense layer
  h = h0 + (target - param_count(cfg)) / per_unit
  return max(multiple, int(round(h / multiple)) * multiple)
