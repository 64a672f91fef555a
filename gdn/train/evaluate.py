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
  task = sets.task
  out = {}
  for split in task.evals:
    sums = None
    for batch in sets.batches(split):
      stats = jax.device_get(eval_step(params, rest, batch))
      sums = stats if sums is None else {k: sums[k] + stats[k] for k in sums}
    s = {k: float(v) for k, v in sums.items()}
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
