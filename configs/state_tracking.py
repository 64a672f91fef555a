"""Reproduction 2: state tracking with beta in (0, 1) vs (0, 2) (Grazzi et al. 2025, negative eigenvalues).

  gdn-compare --config configs/state_tracking.py:small   # CPU, minutes: parity and modular arithmetic
  gdn-compare --config configs/state_tracking.py         # full: + brackets, 3 seeds, 3 learning rates

RecurrentConfig.allow_neg_eigval doubles beta into (0, 2), so the transition I - beta k k^T can have the
eigenvalue -1 that parity needs. Trained at length 64, evaluated up to 512; the table reports the accuracy at
each example's last position (the state of the whole sequence), averaged over the eval lengths.
"""

from configs import base


def models():
  return {
      "deltanet_beta01": base.mixer("deltanet"),
      "deltanet_beta02": base.mixer("deltanet", allow_neg_eigval=True),
      "gated_deltanet_beta01": base.mixer("gated_deltanet"),
      "gated_deltanet_beta02": base.mixer("gated_deltanet", allow_neg_eigval=True),
  }


def get_config(size="full"):
  base.check_size(size)
  c = base.get_config()
  c.name = "state_tracking" if size == "full" else "state_tracking_small"
  # 128 tokens cover every state task (S5 has 120)
  base.task(c, "state", batch_size=64, vocab_size=128, num_layers=2, metric="last_accuracy")
  c.data.state.train_length = 64
  c.data.state.eval_lengths = (64, 256, 512)
  base.apply(c, base.width(128) + base.mixer("deltanet", allow_neg_eigval=True))
  base.schedule(c, 20_000, 500, every=2000)
  c.sweep.models = models()
  c.sweep.settings = {task: (f"data.state.task={task}",) for task in ("parity", "modular", "modular_brackets")}
  c.sweep.seeds = (0, 1, 2)
  c.sweep.learning_rates = (3e-4, 1e-3, 3e-3)
  if size == "small":
    c.data.batch_size = 32
    c.data.state.train_length = 32
    c.data.state.eval_lengths = (32, 128)
    c.data.state.eval_examples = 256
    base.apply(c, base.width(64))
    base.schedule(base.cpu(c), 400, 40, every=400)
    c.sweep.models = {k: v for k, v in models().items() if k.startswith("deltanet")}
    c.sweep.settings = {task: (f"data.state.task={task}",) for task in ("parity", "modular")}
    c.sweep.seeds = (0,)
    c.sweep.learning_rates = (3e-3,)
  return c
