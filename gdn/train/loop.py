"""The training loop: one run of an ExperimentConfig in its work directory, resumed automatically."""

from __future__ import annotations

import json
import os
import time

import jax
import tqdm

from gdn.data import iterator, make_task
from gdn.train import checkpoint, evaluate, metrics, optimizer, sharding, step
from gdn.train.config import ConfigError, ExperimentConfig, to_dict


def _json_default(x):
  return list(x) if isinstance(x, tuple) else str(x)


def write_config(cfg: ExperimentConfig, workdir: str) -> None:
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump(to_dict(cfg), f, indent=2, default=_json_default)


class _NoWriter:
  """The metric writer of processes other than 0: they compute the same metrics, process 0 records them."""

  def write(self, step, prefix, metrics):
    pass

  def close(self):
    pass


def train(cfg: ExperimentConfig, log=print) -> dict:
  """Trains (or resumes) `cfg` in `cfg.run_dir`; returns the summary also written to summary.json.

  The work directory holds config.json (the resolved config), metrics.jsonl, tb/ (TensorBoard),
  checkpoints/ and summary.json. Several processes (after `jax.distributed.initialize()`) run the same call
  on a shared work directory: each loads its own rows of every batch, process 0 alone writes the files other
  than checkpoints and logs.
  """
  workdir = cfg.run_dir
  primary = jax.process_index() == 0
  if not primary:
    log = lambda *a: None
  os.makedirs(workdir, exist_ok=True)
  if primary:
    write_config(cfg, workdir)
  tc = cfg.train
  last = tc.last_step
  B = cfg.data.batch_size

  try:
    mesh = sharding.make_mesh(tc.mesh_data, tc.mesh_fsdp, seq=tc.mesh_seq)
  except ValueError as e:
    if tc.mesh_seq > 1:
      raise ConfigError(f"config.train.mesh_seq={tc.mesh_seq} with mesh_data={tc.mesh_data}, "
                        f"mesh_fsdp={tc.mesh_fsdp}: {e}") from None
    raise ConfigError(f"config.train.mesh_data / mesh_fsdp: {e}") from None
  if B % sharding.batch_devices(mesh):
    raise ConfigError(f"config.data.batch_size {B} must be a multiple of the {sharding.batch_devices(mesh)} "
                      "devices that split the batch (mesh_data * mesh_fsdp)")
  # One process loads whole batches exactly as it always has; with several, each loads its devices' rows.
  rows = sharding.process_rows(mesh, B) if jax.process_count() > 1 else None
  task = make_task(cfg.data, cfg.seed, last, rows)
  if task.vocab_size > cfg.model.vocab_size:
    raise ConfigError(f"config.model.vocab_size {cfg.model.vocab_size} is smaller than the vocabulary of task "
                      f"{task.name!r} ({task.vocab_size})")
  tx = optimizer.make_optimizer(tc)
  lr = optimizer.lr_shape(tc)
  graphdef, state = step.init(cfg.model, tx, cfg.seed)
  n_params = step.num_params(state.params)

  ckpts = checkpoint.Checkpoints(os.path.join(workdir, "checkpoints"), tc.keep_checkpoints)
  restored = ckpts.restore_latest(state)
  data_state, start = None, 0
  if restored is not None:
    state, data_state, start = restored
    log(f"resumed from step {start} in {workdir}")
  state = sharding.shard_state(state, mesh)
  writer = metrics.MetricWriter(workdir, resume_step=start) if primary else _NoWriter()
  data = iterator(task.train, data_state, num_threads=cfg.data.num_threads)
  # Context parallelism in the train step only: eval runs the plain forward on the same mesh (its batches
  # may have fewer rows than the devices that split the batch, and it needs no gradients).
  train_step = step.make_train_step(graphdef, tx, lr, mesh=mesh)
  eval_step = step.make_eval_step(graphdef, mesh)
  sets = evaluate.EvalSets(task, cfg.data.eval_batch, cfg.seed)

  def run_eval(s):
    result = evaluate.evaluate(eval_step, state.params, state.rest, sets)
    writer.write(s, "eval", result)
    return result

  final_eval, stopped = None, False
  # Metrics of step s are fetched after step s + 1 is dispatched, so the host never stalls the device; fetching
  # every step also bounds the steps in flight to two (XLA:CPU can deadlock with many queued donated steps).
  pending = None
  window_tokens, window_start = 0, time.perf_counter()
  bar = tqdm.tqdm(total=last, initial=start, disable=not (tc.progress_bar and primary), dynamic_ncols=True,
                  desc=cfg.name)
  t0 = time.perf_counter()

  def flush(pending):
    nonlocal window_tokens, window_start
    ps, pm = pending
    pm = {k: float(v) for k, v in jax.device_get(pm).items()}
    if ps % tc.log_every == 0 or ps == last:
      now = time.perf_counter()
      pm["tokens_per_s"] = window_tokens / max(now - window_start, 1e-9)
      window_tokens, window_start = 0, now
      writer.write(ps, "train", pm)
      bar.set_postfix(loss=f"{pm['loss']:.4f}", tok_s=f"{pm['tokens_per_s']:.0f}")

  try:
    for s in range(start + 1, last + 1):
      batch = sharding.shard_batch(next(data), mesh, B)
      state, m = train_step(state, batch)
      window_tokens += batch["inputs"].size
      if pending is not None:
        flush(pending)
      pending = (s, m)
      bar.update(1)
      if (tc.eval_every and s % tc.eval_every == 0) or s == last:
        final_eval = run_eval(s)
        log(f"step {s}: " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(final_eval.items()) if "/" not in k))
        stopped = tc.early_stop > 0 and final_eval[tc.early_stop_metric] >= tc.early_stop
      if (tc.checkpoint_every and s % tc.checkpoint_every == 0) or s == last or stopped:
        ckpts.save(s, state, data.get_state())
      if stopped:
        log(f"step {s}: eval {tc.early_stop_metric} reached {tc.early_stop}; stopping early")
        last = s
        break
    if pending is not None:
      flush(pending)
    if final_eval is None:  # resumed at the last step: nothing left to train
      final_eval = run_eval(last)
  finally:
    bar.close()
    ckpts.close()
    writer.close()

  # steps: the steps trained, fewer than train.last_step when stopped_early.
  summary = dict(name=cfg.name, workdir=os.path.abspath(workdir), steps=last, stopped_early=stopped,
                 params=n_params, seconds=time.perf_counter() - t0, eval=final_eval)
  if primary:
    with open(os.path.join(workdir, "summary.json"), "w") as f:
      json.dump(summary, f, indent=2)
  return summary
