"""Reproduction 4: hybrid ratios of Gated DeltaNet and attention on byte-level text, 8 layers.

  gdn-compare --config configs/hybrid.py:small   # CPU, minutes
  gdn-compare --config configs/hybrid.py         # full

ModelConfig.pattern repeats over the layers: "R" pure Gated DeltaNet, "RA" 1:1, "RRRA" 3:1, "RRRRRRRA" 7:1,
"A" pure attention. The table reports validation bits per byte (lower is better).
"""

from configs import base

PATTERNS = {"gdn": "R", "hybrid_1to1": "RA", "hybrid_3to1": "RRRA", "hybrid_7to1": "RRRRRRRA", "attention": "A"}


def get_config(size="full"):
  c = base.byte_lm(base.get_config(), "hybrid", base.check_size(size), num_layers=8)
  base.apply(c, base.width(256 if size == "full" else 64) + base.mixer("gated_deltanet"))
  c.sweep.models = {name: base.mixer("gated_deltanet", pattern=p) for name, p in PATTERNS.items()}
  return c
