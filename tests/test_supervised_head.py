"""`train.supervised_head`: the output head and the loss at each row's supervised positions only (MQAR's queries),
the same statistics, loss and gradients as over every position."""

import os

import jax
import numpy as np
import pytest
from flax import nnx

from gdn.config import AttentionConfig, ModelConfig, RecurrentConfig
from gdn.data import mqar
from gdn.model import LanguageModel
from gdn.train import step
from gdn.train.config import ConfigError
from gdn.train.config_file import resolve
from gdn.train.metrics import read_jsonl
from test_train import assert_same_loss

pytestmark = pytest.mark.usefixtures("fast_compile")


def _mqar_batch(T=32, P=4, B=3, vocab=64):
  cfg = mqar.MQARConfig(vocab_size=vocab, train_settings=((T, P),), eval_settings=((T, P),))
  batch = mqar.batch(cfg, np.random.default_rng(0), B, T, P)
  batch["weights"][1] = 0.0  # a row without supervised positions
  return batch


def test_statistics_loss_and_gradients_equal_the_whole_head():
  """At M = the pairs (and M larger), every statistic, the loss and the gradients are those of the head at every
  position; at M below the pairs the weights, and so the loss, are NaN instead of short."""
  cfg = ModelConfig(vocab_size=64, d_model=32, num_layers=2, pattern="RA",
                    recurrent=RecurrentConfig(num_heads=2, head_dim=16),
                    attention=AttentionConfig(num_heads=2, head_dim=16))
  batch = _mqar_batch()
  assert (batch["weights"].sum(-1) <= 4).all() and batch["weights"][0].sum() == 4
  graph, params, rest = nnx.split(LanguageModel(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)

  def loss(p, M):
    stats = step.model_stats(nnx.merge(graph, p, rest), batch, supervised=M)
    return stats["nll"] / stats["weight"], stats

  @jax.jit
  def values_and_grads(p):
    return [jax.value_and_grad(loss, has_aux=True)(p, M) for M in (0, 4, 9, 3)]

  ref, *got, ((short, short_stats), _) = values_and_grads(params)
  for one in got:
    assert_same_loss(one, ref)
  assert np.isnan(float(short)) and np.isnan(float(short_stats["weight"]))


def test_supervised_positions_keeps_time_order():
  batch = dict(targets=np.arange(10)[None].repeat(2, 0), weights=np.zeros((2, 10), np.float32))
  batch["weights"][0, [7, 2, 5]] = 1.0
  batch["weights"][1, 9] = 1.0
  x = np.arange(20, dtype=np.float32).reshape(2, 10, 1)
  x_g, b = step.supervised_positions(x, batch, 3)
  np.testing.assert_array_equal(np.asarray(b["targets"])[0], [2, 5, 7])
  assert np.asarray(b["targets"])[1, 0] == 9 and np.asarray(b["weights"])[1].tolist() == [1.0, 0.0, 0.0]
  np.testing.assert_array_equal(np.asarray(x_g)[0, :, 0], [2, 5, 7])


@pytest.mark.slow
def test_a_run_with_it_logs_the_same_losses(tmp_path):
  """gdn-train's loop on MQAR with and without it: the same training losses and eval accuracies to float32
  rounding; a task without a bound on its supervised positions is refused by name."""
  from gdn.train.loop import train

  base = ("model.d_model=32", "model.attention.head_dim=16", "data.batch_size=8", "model.vocab_size=64",
          "data.mqar.vocab_size=64", "train.steps=12", "train.warmup_steps=2", "train.eval_every=6",
          "data.mqar.eval_examples=8", "train.log_every=1")
  logs = {}
  for on in (False, True):
    cfg = resolve("configs/mqar_probe.py", base + (f"train.supervised_head={on}", f"workdir={tmp_path / str(on)}"))
    train(cfg, log=lambda *a: None)
    logs[on] = read_jsonl(os.path.join(tmp_path / str(on), "metrics.jsonl"))
  pick = lambda rows, key: [r[key] for r in rows if key in r]
  for key in ("train/loss", "eval/loss", "eval/accuracy"):
    assert pick(logs[True], key), key
    np.testing.assert_allclose(pick(logs[True], key), pick(logs[False], key), rtol=2e-5, err_msg=key)
  cfg = resolve("configs/state_tracking.py:small", ("train.supervised_head=True", f"workdir={tmp_path / 's'}",
                                                    "train.steps=2", "train.warmup_steps=1"))
  with pytest.raises(ConfigError, match="supervised_head needs a task"):
    train(cfg, log=lambda *a: None)


def test_the_benchmark_prints_both_rows(capsys):
  from experiments import bench_supervised_head

  rows = bench_supervised_head.main(["--config", "configs/mqar_zoology.py:small", "--setting", "T64_P4_d64",
                                     "--reps", "1", "--override", "data.batch_size=4"])
  assert [r["supervised"] for r in rows] == [0, 4]
  assert rows[1]["bytes"] < rows[0]["bytes"]  # the logits of 4 positions a row instead of 64
  assert "| 4 supervised positions a row |" in capsys.readouterr().out
  with pytest.raises(SystemExit, match="no sweep setting 'nope'"):
    bench_supervised_head.main(["--config", "configs/mqar_zoology.py:small", "--setting", "nope"])
  with pytest.raises(SystemExit, match="bounds its supervised positions at 0"):
    bench_supervised_head.main(["--config", "configs/state_tracking.py:small"])
