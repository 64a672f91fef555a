"""Steps to solve: train a config and evaluate every few steps until an eval metric crosses a threshold.

A diagnosis tool, not a second training loop: the model, optimizer, train step, data and evaluation are the
ones `gdn.train.loop.train` uses; there are no checkpoints, and training stops at the first evaluation that
reaches `threshold` (as Zoology stops at 0.99 validation accuracy).
"""

from __future__ import annotations

import time

import jax

from gdn.data import iterator, make_task
from gdn.train import evaluate, optimizer, step
from gdn.train.config import ExperimentConfig


def steps_to_solve(cfg: ExperimentConfig, *, metric: str = "accuracy", threshold: float = 0.99,
                   eval_every: int = 100, log=print) -> dict:
  """{"solved_at": first evaluated step with eval `metric` >= threshold (None if never, up to
  cfg.train.last_step), "final": the last evaluation, "curve": [{step, train_loss, eval metrics}], "seconds"}."""
  tc = cfg.train
  last = tc.last_step
  task = make_task(cfg.data, cfg.seed, last)
  tx = optimizer.make_optimizer(tc)
  graphdef, state = step.init(cfg.model, tx, cfg.seed)
  train_step = step.make_train_step(graphdef, tx, optimizer.lr_shape(tc))
  eval_step = step.make_eval_step(graphdef)
  sets = evaluate.EvalSets(task, cfg.data.eval_batch, cfg.seed)
  data = iterator(task.train, num_threads=cfg.data.num_threads)
  curve, solved, t0 = [], None, time.perf_counter()
  for s in range(1, last + 1):
    state, m = train_step(state, next(data))
    if s % eval_every and s != last:
      continue
    result = evaluate.evaluate(eval_step, state.params, state.rest, sets)
    point = dict(step=s, train_loss=float(jax.device_get(m["loss"])),
                 **{k: v for k, v in result.items() if "/" not in k})
    curve.append(point)
    log(f"{cfg.name} step {s}: train_loss {point['train_loss']:.3f}, eval {metric} {result[metric]:.4f}")
    if result[metric] >= threshold:
      solved = s
      break
  return dict(solved_at=solved, final=curve[-1], curve=curve, seconds=time.perf_counter() - t0)
