"""Evaluation over a task's fixed splits: loss, token accuracy, whole-example accuracy per split."""

from __future__ import annotations

import math

import jax
import numpy as np

from gdn.data import Task, eval_batches


class EvalSets:
  """The eval batches of a task, drawn once and reused at every evaluation."""

  def __init__(self, task: Task, batch_size: int, seed: int):
    self.task, self.batch_size, self.seed = task, batch_size, seed
    self._batches = {}

  def batches(self, split):
    if split.name not in self._batches:
      self._batches[split.name] = eval_batches(split, self.batch_size, self.seed)
    return self._batches[split.name]


def evaluate(eval_step, params, rest, sets: EvalSets) -> dict:
  """Per split: loss, accuracy (weighted tokens), seq_accuracy (examples with every supervised token right),
  last_accuracy (each example's last supervised token), bits_per_byte for byte-level text, scaled_accuracy
  (acc - chance) / (1 - chance) where chance is known. Keys "<split>/<name>", and "<name>" for the mean over
  splits."""
  return metrics(sets.task, {split.name: add(eval_step(params, rest, batch) for batch in sets.batches(split))
                             for split in sets.task.evals})


def add(stats) -> dict:
  """The sums over batches of `eval_step` statistics, on the host (arrays of any shape, summed elementwise)."""
  sums = None
  for s in stats:
    s = jax.device_get(s)
    sums = s if sums is None else {k: sums[k] + s[k] for k in sums}
  return sums


def metric_names(task: Task) -> list:
  """The names `evaluate` returns for `task` (means over splits; each also as "<split>/<name>")."""
  return (["loss", "accuracy", "seq_accuracy", "last_accuracy"] + ["bits_per_byte"] * bool(task.bits_per_token)
          + ["scaled_accuracy"] * (task.chance > 0))


def metrics(task: Task, sums: dict) -> dict:
  """`evaluate`'s metrics from the statistics summed over each split's batches ({split name: sums})."""
  out = {}
  for split in task.evals:
    s = {k: float(v) for k, v in sums[split.name].items()}
    m = dict(loss=s["nll"] / max(s["weight"], 1.0), accuracy=s["correct"] / max(s["weight"], 1.0),
             seq_accuracy=s["seq_correct"] / max(s["seqs"], 1.0), last_accuracy=s["last_correct"] / max(s["seqs"], 1.0))
    if task.bits_per_token:
      m["bits_per_byte"] = m["loss"] / math.log(2)
    if task.chance > 0:
      m["scaled_accuracy"] = (m["accuracy"] - task.chance) / (1.0 - task.chance)
    out.update({f"{split.name}/{k}": v for k, v in m.items()})
  for k in sorted({k.split("/", 1)[1] for k in out}):
    out[k] = float(np.mean([out[f"{s.name}/{k}"] for s in task.evals]))
  return out
