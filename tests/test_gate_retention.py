"""experiments/gate_retention.py: what a decay gate keeps over a distance, and its at-initialisation mode."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from experiments import gate_retention
from gdn.model import LanguageModel
from gdn.train import step
from gdn.train.config_file import resolve

TINY = ["--override", "model.d_model=32", "--override", "model.recurrent.num_heads=2",
        "--override", "model.recurrent.head_dim=16", "--override", "model.num_layers=2"]


def test_kept_before_sums_the_decays_of_the_window_ending_at_the_answer():
  g = np.full((2, 10, 3), -0.1)
  g[1, :, 2] = 0.0
  np.testing.assert_allclose(gate_retention.kept_before(g, np.array([9, 5]), 4),
                             [np.exp(-0.4), np.exp(-0.4), (np.exp(-0.4) + 1) / 2])
  # a window ending at position 5 covers positions 2..5: a decay elsewhere does not count
  g[1, 6:, 0] = -50.0
  assert gate_retention.kept_before(g, np.array([9, 5]), 4)[0] == pytest.approx(np.exp(-0.4))
  # per key channel: the mean of the log decay over the channels
  gc = np.stack([np.full((1, 4, 1), -0.2), np.full((1, 4, 1), 0.0)], -1)
  np.testing.assert_allclose(gate_retention.kept_before(gc, np.array([3]), 2), [np.exp(-0.2)])


def test_at_initialisation_prints_every_layer_and_no_gate_for_deltanet(capsys):
  gate_retention.main(["--config", "configs/niah.py:small", "--sweep-model", "gated_deltanet", "--seeds", "0,1",
                       "--examples", "2", "--distances", "4,16,4096", *TINY])
  out = capsys.readouterr().out
  assert out.count("at initialisation: split sniah1_T64") == 2
  layers = [line for line in out.splitlines() if line.startswith("  layer ")]
  assert len(layers) == 4 and all("kept over 4: " in line and "over 16: " in line for line in layers)
  assert "over 4096" not in out  # longer than the examples: left out
  kept = [float(x) for x in layers[0].split("kept over 4: ")[1].split(";")[0].split()]
  assert len(kept) == 2 and all(0 <= x <= 1 for x in kept)
  gate_retention.main(["--config", "configs/niah.py:small", "--sweep-model", "deltanet", "--examples", "2", *TINY])
  assert "no decay gate" in capsys.readouterr().out
  with pytest.raises(SystemExit, match="'nope' is not an eval split"):
    gate_retention.main(["--config", "configs/niah.py:small", "--split", "nope", *TINY])
  with pytest.raises(SystemExit, match="'nope' is not a model of"):
    gate_retention.main(["--config", "configs/niah.py:small", "--sweep-model", "nope"])
  with pytest.raises(SystemExit, match="train_file"):  # a text task without its corpus: the key, no traceback
    gate_retention.main(["--config", "configs/lm_ablations.py", "--override", "data.text.train_file=/nonexistent"])


def test_its_initialisation_is_the_training_runs():
  """Seed s here is the model a training run of seed s starts from, stacked (a key) or not (an int)."""
  cfg = resolve("configs/niah.py:small", ["model.d_model=32", "model.recurrent.num_heads=2",
                                          "model.recurrent.head_dim=16", "model.num_layers=2"])
  here = nnx.state(LanguageModel(cfg.model, rngs=nnx.Rngs(3)), nnx.Param)
  _, state = step.init(cfg.model, optax.sgd(0.1), jax.random.key(3))
  for a, b in zip(jax.tree.leaves(here), jax.tree.leaves(state.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
