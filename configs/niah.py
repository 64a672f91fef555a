"""Needle in a haystack (S-NIAH-1 style): train at 1K, evaluate at 1K-8K; Gated DeltaNet, hybrid, attention.

  gdn-compare --config configs/niah.py:small   # CPU: train at 256, evaluate at 256-1K
  gdn-compare --config configs/niah.py         # full
"""

from configs import base


def get_config(size="full"):
  base.check_size(size)
  c = base.get_config()
  c.name = "niah" if size == "full" else "niah_small"
  base.task(c, "niah", batch_size=16, vocab_size=512, num_layers=4, metric="seq_accuracy")
  c.data.eval_batch_size = 8
  base.apply(c, base.width(256) + base.mixer("gated_deltanet"))
  base.schedule(c, 5000, 250, every=1000)
  c.sweep.models = {"gated_deltanet": base.mixer("gated_deltanet"),
                    "hybrid_3to1": base.mixer("gated_deltanet", pattern="RRRA"), "attention": base.mixer("attention")}
  if size == "small":
    c.data.niah.train_lengths = (256,)
    c.data.niah.eval_lengths = (256, 512, 1024)
    c.data.niah.eval_examples = 32
    base.apply(c, base.width(64))
    base.schedule(base.cpu(c), 300, 30, every=300, learning_rate=3e-3)
  return c
