"""Why 2-layer attention fails MQAR here: steps to solve at vocabularies 256 / 1024 / 8192 (CPU, small).

  python -m experiments.steps_to_solve --config configs/mqar_probe.py --eval_every 100

One (length, pairs) setting, T = 64 with 4 pairs, trained and evaluated alone; d_model 64, 2 layers,
batch 64, a budget of `train.steps` steps, stopping at 0.99 eval accuracy. Settings are vocabularies.
"""

from configs import base


def vocab(v: int) -> tuple:
  return (f"model.vocab_size={v}", f"data.mqar.vocab_size={v}")


def get_config():
  c = base.get_config()
  c.name = "mqar_probe"
  c.data.task = "mqar"
  c.data.batch_size = 64
  c.data.mqar.train_settings = ((64, 4),)
  c.data.mqar.eval_settings = ((64, 4),)
  c.data.mqar.eval_examples = 256
  c.model.num_layers = 2
  base.apply(c, base.width(64) + base.mixer("attention") + vocab(8192))
  c.train.steps = 1500
  c.train.warmup_steps = 100
  c.sweep.models = {"attention": base.mixer("attention")}
  c.sweep.settings = {f"vocab{v}": vocab(v) for v in (256, 1024, 8192)}
  c.sweep.learning_rates = (1e-3,)
  c.sweep.metric = "accuracy"
  return c
