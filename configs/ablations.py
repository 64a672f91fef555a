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
  base.check_size(size)
  c = base.get_config()
  c.name = "ablations" if size == "full" else "ablations_small"
  c.data.task = "bytes"
  c.data.batch_size = 32
  c.data.eval_batch_size = 32
  c.data.text.seq_len = 512
  c.data.text.eval_examples = 512
  c.model.vocab_size = 256
  c.model.num_layers = 4
  base.apply(c, base.mixer("gated_deltanet"))
  base.apply(c, ("model.d_model=256", "model.recurrent.num_heads=2", "model.recurrent.head_dim=128"))
  c.train.steps = 5000
  c.train.warmup_steps = 250
  c.train.learning_rate = 1e-3
  c.train.eval_every = 1000
  c.train.checkpoint_every = 1000
  c.sweep.models = models(256, (64, 256))
  c.sweep.metric = "bits_per_byte"
  c.sweep.mode = "min"
  if size == "small":
    c.data.batch_size = 16
    c.data.text.seq_len = 128
    c.data.text.eval_examples = 128
    c.model.num_layers = 2
    base.apply(c, ("model.d_model=64", "model.recurrent.num_heads=2", "model.recurrent.head_dim=32"))
    c.model.recurrent.method = "recurrent"  # compiles faster on CPU than the chunked form
    c.train.steps = 200
    c.train.warmup_steps = 20
    c.train.learning_rate = 3e-3
    c.train.eval_every = 200
    c.train.checkpoint_every = 200
    c.sweep.models = models(64, (16, 64))
  return c
