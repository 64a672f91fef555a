"""Reproduction 3: the Gated DeltaNet block ablations (Yang et al. 2025, Table S.1) on byte-level text.

  gdn-compare --config configs/ablations.py:small   # CPU, minutes
  gdn-compare --config configs/ablations.py         # full

Text: the Python standard library's source as bytes (gdn.data.text). Each model is the baseline with one
switch changed; the head-dim variants keep num_heads * head_dim = d_model. The table reports validation
bits per byte (lower is better).
"""

from configs import base


def models(d_model: int, head_dims):
  baseline = base.mixer("gated_deltanet")
  out = {"baseline": baseline}
  for name, override in (("no_decay", "decay=none"), ("no_short_conv", "short_conv=false"),
                         ("no_output_gate", "output_gate=none"), ("no_output_norm", "output_norm=false"),
                         ("beta_per_channel", "beta=channel")):
    out[name] = baseline + (f"model.recurrent.{override}",)
  for hd in head_dims:
    out[f"head_dim_{hd}"] = baseline + (f"model.recurrent.head_dim={hd}",
                                        f"model.recurrent.num_heads={max(1, d_model // hd)}")
  return out


def get_config(size="full"):
  small = base.check_size(size) == "small"
  c = base.byte_lm(base.get_config(), "ablations", size, num_layers=2 if small else 4)
  base.apply(c, base.mixer("gated_deltanet"))
  d_model, head_dim = (64, 32) if small else (256, 128)
  base.apply(c, (f"model.d_model={d_model}", "model.recurrent.num_heads=2", f"model.recurrent.head_dim={head_dim}"))
  c.sweep.models = models(d_model, (16, 64) if small else (64, 256))
  return c
