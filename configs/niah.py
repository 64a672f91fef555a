"""Needle in a haystack (S-NIAH-1 style): train at 1K, evaluate at 1K-8K; Gated DeltaNet, hybrid, attention.

  gdn-compare --config configs/niah.py:small   # CPU: train at 256, evaluate at 256-1K
  gdn-compare --config configs/niah.py         # full
"""

from configs import base


def get_config(size="full"):
  base.check_size(size)
  c = base.get_config()
  c.name = "niah" if size == "full" else "niah_small"
  c.data.task = "niah"
  c.data.batch_size = 16
  c.data.eval_batch_size = 8
  c.model.vocab_size = 512
  c.model.num_layers = 4
  base.apply(c, base.width(256) + base.mixer("gated_deltanet"))
  c.train.steps = 5000
  c.train.warmup_steps = 250
  c.train.eval_every = 1000
  c.train.checkpoint_every = 1000
  c.sweep.models = {"gated_deltanet": base.mixer("gated_deltanet"),
                    "hybrid_3to1": base.mixer("gated_deltanet", pattern="RRRA"), "attention": base.mixer("attention")}
  c.sweep.metric = "seq_accuracy"
  if size == "small":
    c.data.niah.train_lengths = (256,)
    c.data.niah.eval_lengths = (256, 512, 1024)
    c.data.niah.eval_examples = 32
    base.apply(c, base.width(64))
    c.model.recurrent.method = "recurrent"  # compiles faster on CPU than the chunked form
    c.train.steps = 300
    c.train.warmup_steps = 30
    c.train.learning_rate = 3e-3
    c.train.eval_every = 300
    c.train.checkpoint_every = 300
  return c
