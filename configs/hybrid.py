"""Reproduction 4: hybrid ratios of Gated DeltaNet and attention on byte-level text, 8 layers.

  gdn-compare --config configs/hybrid.py:small   # CPU, minutes
  gdn-compare --config configs/hybrid.py         # full

ModelConfig.pattern repeats over the layers: "R" pure Gated DeltaNet, "RA" 1:1, "RRRA" 3:1, "RRRRRRRA" 7:1,
"A" pure attention. The table reports validation bits per byte (lower is better).
"""

from configs import base

PATTERNS = {"gdn": "R", "hybrid_1to1": "RA", "hybrid_3to1": "RRRA", "hybrid_7to1": "RRRRRRRA", "attention": "A"}


def get_config(size="full"):
  base.check_size(size)
  c = base.get_config()
  c.name = "hybrid" if size == "full" else "hybrid_small"
  c.data.task = "bytes"
  c.data.batch_size = 32
  c.data.eval_batch_size = 32
  c.data.text.seq_len = 512
  c.data.text.eval_examples = 512
  c.model.vocab_size = 256
  c.model.num_layers = 8
  base.apply(c, base.width(256) + base.mixer("gated_deltanet"))
  c.train.steps = 5000
  c.train.warmup_steps = 250
  c.train.learning_rate = 1e-3
  c.train.eval_every = 1000
  c.train.checkpoint_every = 1000
  c.sweep.models = {name: base.mixer("gated_deltanet", pattern=p) for name, p in PATTERNS.items()}
  c.sweep.metric = "bits_per_byte"
  c.sweep.mode = "min"
  if size == "small":
    c.data.batch_size = 16
    c.data.text.seq_len = 128
    c.data.text.eval_examples = 128
    base.apply(c, base.width(64))
    c.model.recurrent.method = "recurrent"  # compiles faster on CPU than the chunked form
    c.train.steps = 200
    c.train.warmup_steps = 20
    c.train.learning_rate = 3e-3
    c.train.eval_every = 200
    c.train.checkpoint_every = 200
  return c
