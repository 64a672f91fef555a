"""Why 2-layer attention fails MQAR here: steps to solve at vocabularies 256 to 8192 (CPU, small).

  gdn-compare --config configs/mqar_probe.py

One (length, pairs) setting, T = 64 with 4 pairs, trained and evaluated alone; d_model 64, 2 layers,
batch 64; each run stops at 0.99 eval accuracy or after `train.steps`. Settings are vocabularies; 3 seeds at
each of two rates.
"""

from configs import base


def get_config():
  c = base.get_config()
  c.name = "mqar_probe"
  base.task(c, "mqar", batch_size=64, vocab_size=8192, num_layers=2)
  c.data.mqar.train_settings = ((64, 4),)
  c.data.mqar.eval_settings = ((64, 4),)
  c.data.mqar.eval_examples = 256
  base.apply(c, base.width(64) + base.mixer("attention"))
  base.schedule(c, 4000, 200, every=100)
  c.train.checkpoint_every = 4000
  c.train.early_stop = 0.99
  c.train.progress_bar = False
  c.train.supervised_head = True  # the head at the 4 queries of a row: the same loss (docs/experiments.md, Training)
  c.sweep.models = {"attention": base.mixer("attention")}
  c.sweep.settings = {f"vocab{v}": base.vocab(v) for v in (256, 512, 1024, 2048, 8192)}
  # 3e-3 gets every vocabulary off attention's plateau within 4,000 steps; 1e-3 does not at 1024 and 2048
  # (results/mqar_probe/, docs/experiments.md reproduction 1), so both rates run
  c.sweep.seeds, c.sweep.learning_rates = (0, 1, 2), (1e-3, 3e-3)
  return c
