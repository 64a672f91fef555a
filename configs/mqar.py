"""Reproduction 1: MQAR (Zoology, Arora et al. 2023) over mixers x d_model, 2 layers.

  gdn-compare --config configs/mqar.py:small   # CPU, ~1 h: 4 models at d_model 64 x 3 seeds, lr 1e-3
  gdn-compare --config configs/mqar.py         # full: 7 models x d_model {64, 128, 256} x 4 learning rates

Full: trained on a mixture of the four (length, pairs) settings, evaluated on each. Small: one setting,
length 64 with 4 pairs, vocabulary 256 (the probe's, configs/mqar_probe.py), stopping at 0.99. The hybrid
needs 4 layers for a 3:1 pattern (RRRA); every other model has 2.
"""

from configs import base

LRS = (1e-4, 4.6e-4, 2.2e-3, 1e-2)  # Zoology's np.logspace(-4, -2, 4), rounded


def models(names):
  out = {name: base.mixer(name) for name in names if name != "hybrid_3to1"}
  if "hybrid_3to1" in names:
    out["hybrid_3to1"] = base.mixer("gated_deltanet", pattern="RRRA") + ("model.num_layers=4",)
  return out


def get_config(size="full"):
  base.check_size(size)
  c = base.get_config()
  c.name = "mqar" if size == "full" else "mqar_small"
  base.task(c, "mqar", batch_size=128, vocab_size=8192, num_layers=2)
  base.apply(c, base.width(128) + base.mixer("gated_deltanet"))
  base.schedule(c, 10_000, 500, every=1000)
  c.train.supervised_head = True  # the head at a row's queries only: the same loss (docs/experiments.md, Training)
  c.sweep.models = models(base.MIXERS + ("hybrid_3to1",))
  c.sweep.settings = {f"d{d}": base.width(d) for d in (64, 128, 256)}
  c.sweep.learning_rates = LRS
  c.sweep.x_key = "model.d_model"
  if size == "small":
    # the probe's easy setting (results/mqar_probe: attention 0.977 at step 1,500, lr 1e-3): one (length, pairs)
    # setting, vocabulary 256, d_model 64, batch 64, 1,000 steps; every model gets the same rate and seeds (one
    # rate to fit about an hour on 2 shared CPU cores; seed 0 at 3e-3 as well: docs/experiments.md)
    base.task(c, "mqar", batch_size=64, vocab_size=256, num_layers=2)
    c.data.mqar.train_settings = c.data.mqar.eval_settings = ((64, 4),)
    c.data.mqar.eval_examples = 256
    base.schedule(base.cpu(c), 1000, 100, every=100)
    c.train.checkpoint_every = 1000
    c.train.early_stop = 0.99
    c.train.progress_bar = False
    c.sweep.models = models(("attention", "deltanet", "gated_deltanet", "hybrid_3to1"))
    c.sweep.settings = {"d64": base.width(64)}
    c.sweep.seeds = (0, 1, 2)
    c.sweep.learning_rates = (1e-3,)
  return c
