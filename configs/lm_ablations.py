"""The Gated DeltaNet block ablations (Yang, Kautz, Hatamizadeh, ICLR 2025, Table S.1) on the gdn-corpus bytes,
every training byte seen at most once, parameter-matched, 3 seeds x 5 learning rates.

  python -m gdn.data.corpus --out data/pycode_small --roots stdlib --max-bytes 4000000
  gdn-compare --config configs/lm_ablations.py:small   # CPU, minutes
  python -m gdn.data.corpus --out data/pycode          # ~300 MB, seconds
  gdn-compare --config configs/lm_ablations.py         # GPU (docs/experiments.md: the pieces for one H200)

The rows of Table S.1 that our switches express: the baseline (Gated DeltaNet, head dim 128), the naive delta
rule (no decay gate alpha), no short convolution (q, k, v keep their SiLU, as fla's layer does without its
conv), no output gate, no output norm, head dim 64 and 256, half and double the baseline's 128 (`head_dim_half`,
`head_dim_double`; small: 16 and 64 beside 32; heads x head_dim = d_model throughout). Its four
L1/L2-norm x ReLU/1+ELU/SiLU rows need q/k feature maps that RecurrentConfig does not have; they are left out.

Full: 6 layers, d_model 512, baseline 4 heads of 128, 65.5M training bytes per run of the ~300 MB corpus.
Parameters are matched to the baseline's through the dense MLP width (configs.base.matched): a removed output
gate frees d_model^2 per layer, which the MLP takes back. The metric is validation bits per byte.
"""

from configs import base

# Table S.1's Avg-PPL per row (lower is better); its L1/L2-norm and feature-map rows have no switch here.
PUBLISHED = dict(baseline=27.35, naive_delta_rule=30.87, no_short_conv=28.95, no_output_gate=29.12,
                 no_output_norm=27.55, head_dim_half=28.31, head_dim_double=27.13)
HEAD_DIMS = {"full": (512, 128, (64, 256)), "small": (64, 32, (16, 64))}  # d_model, baseline head dim, variants


def models(d_model: int, head_dim: int, variants) -> dict:
  baseline = base.mixer("gated_deltanet") + (f"model.recurrent.num_heads={d_model // head_dim}",
                                             f"model.recurrent.head_dim={head_dim}")
  out = {"baseline": baseline}
  for name, switches in (("naive_delta_rule", ("decay=none",)),
                         ("no_short_conv", ("short_conv=false", "silu_without_conv=true")),
                         ("no_output_gate", ("output_gate=none",)),
                         ("no_output_norm", ("output_norm=false",))):
    out[name] = baseline + tuple(f"model.recurrent.{s}" for s in switches)
  for name, hd in zip(("head_dim_half", "head_dim_double"), variants):
    out[name] = baseline + (f"model.recurrent.head_dim={hd}", f"model.recurrent.num_heads={d_model // hd}")
  return out


def get_config(size="full"):
  size = base.check_size(size)
  d_model, head_dim, variants = HEAD_DIMS[size]
  c = base.pycode_lm(base.get_config(), "lm_ablations", size, num_layers=6 if size == "full" else 2)
  c.model.d_model = d_model
  c.sweep.models = base.matched(c, models(d_model, head_dim, variants), "baseline")
  c.sweep.published = {"gdn_table_s1": dict(
      source="Gated DeltaNet (Yang, Kautz, Hatamizadeh, ICLR 2025), Table S.1: 400M parameters, 15B tokens",
      metric="Avg-PPL", reference="baseline", values=PUBLISHED)}
  return c
