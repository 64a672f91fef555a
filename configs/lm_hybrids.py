"""Hybrids on the gdn-corpus bytes, every training byte seen at most once, parameter-matched, 3 seeds x 5 rates:
the Gated DeltaNet paper's H1 and H2 (Yang, Kautz, Hatamizadeh, ICLR 2025, Fig. 1 and its language-modelling table) and Kimi Linear's
ratios of KDA to full attention (Kimi Team 2025, Table 1).

  python -m gdn.data.corpus --out data/pycode_small --roots stdlib --max-bytes 4000000
  gdn-compare --config configs/lm_hybrids.py:small   # CPU, minutes
  python -m gdn.data.corpus --out data/pycode          # ~300 MB, seconds
  gdn-compare --config configs/lm_hybrids.py         # GPU (docs/experiments.md: the pieces for one H200)

16 layers (Kimi Linear's ratio ablation is 16 layers deep, so 15:1 holds exactly one attention layer), pattern
per model:

  transformer   "A"                 Transformer++ of the GDN paper; Kimi's 0:1
  gdn           "R"                 pure Gated DeltaNet
  gdn_h1        "RW"                H1: Gated DeltaNet + sliding-window attention, alternating
  gdn_h2        "MRW"               H2: Mamba2 + Gated DeltaNet + sliding-window attention, repeated; 16 layers
                                    are 5 1/3 groups, so H2 has 15 (5 groups) and its MLPs widen to match
  kda_1to1 ... kda_15to1  "RA", "RRRA", "R"*7 + "A", "R"*15 + "A" with R = KDA (Kimi's 1:1, 3:1, 7:1, 15:1)

The window is half the training length, as the GDN paper's 2K of 4K. "M" layers are our Mamba2 stand-in: the
gated linear attention of gdn.config.PRESETS["gla_mamba2"] (Mamba2's per-head decay, no delta rule) in the
same block as the other mixers. Full: d_model 256, recurrent heads 2 x 128, attention heads 4 x 64, parameters
matched to the pure Gated DeltaNet's through the dense MLP width. Metric: validation bits per byte.
"""

from configs import base

# Published perplexities (lower is better) under our model names.
GDN_LM_TABLE = dict(transformer=18.53, gdn=16.42, gdn_h1=16.07, gdn_h2=15.91)
KIMI_TABLE1 = dict(transformer=5.77, kda_1to1=5.66, kda_3to1=5.65, kda_7to1=5.70, kda_15to1=5.82)
KIMI_RATIOS = {"kda_1to1": "RA", "kda_3to1": "RRRA", "kda_7to1": "R" * 7 + "A", "kda_15to1": "R" * 15 + "A"}
SIZES = {"full": dict(d_model=256, heads=2, attention_heads=4), "small": dict(d_model=32, heads=2, attention_heads=2)}


def models(num_layers: int) -> dict:
  gdn = lambda pattern: base.mixer("gated_deltanet", pattern=pattern)
  out = {"transformer": gdn("A"), "gdn": gdn("R"), "gdn_h1": gdn("RW"),
         "gdn_h2": gdn("MRW") + (f"model.num_layers={num_layers - num_layers % 3}",)}
  out.update({name: base.mixer("kda", pattern=p) for name, p in KIMI_RATIOS.items()})
  return out


def get_config(size="full"):
  size = base.check_size(size)
  s = SIZES[size]
  c = base.pycode_lm(base.get_config(), "lm_hybrids", size, num_layers=16)
  d, H, HA = s["d_model"], s["heads"], s["attention_heads"]
  c.model.d_model = d
  c.model.recurrent.num_heads, c.model.recurrent.head_dim = H, d // H
  c.model.mamba2.num_heads, c.model.mamba2.head_dim = H, d // H
  c.model.attention.num_heads, c.model.attention.head_dim = HA, d // HA
  c.model.attention.window = c.data.text.seq_len // 2
  if size == "small":
    c.model.mamba2.method = "recurrent"
  c.sweep.models = base.matched(c, models(16), "gdn")
  c.sweep.published = {
      "gdn_lm_table": dict(source="Gated DeltaNet (Yang, Kautz, Hatamizadeh, ICLR 2025), language-modelling table: "
                                  "1.3B parameters, 100B tokens", metric="Wiki. ppl", reference="gdn",
                           values=GDN_LM_TABLE),
      "kimi_table1": dict(source="Kimi Linear (Kimi Team 2025), Table 1: hybrid ratio KDA:MLA, 16 layers",
                          metric="validation PPL", reference="transformer", values=KIMI_TABLE1)}
  return c
