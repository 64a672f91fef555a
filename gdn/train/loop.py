"""The training loop: one run of an ExperimentConfig in its work directory, resumed automatically."""

from __future__ import annotations

import json
import os
import time

import jax
import tqdm
from jax.experimental import multihost_utils

from gdn.data import corpus, iterator, make_task
from gdn.train import checkpoint, evaluate, metrics, optimizer, sharding, step, workdir as workdirs
from gdn.train.config import ConfigError, ExperimentConfig


class NonFiniteLoss(RuntimeError):
  """Training met more steps with a non-finite loss or gradient norm than train.skip_nonfinite allows."""


def _sync(name: str) -> None:
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


class _NoWriter:
  """The metric writer of processes other than 0: they compute the same metrics, process 0 records them."""

  def write(self, step, prefix, metrics):
    pass

  def close(self):
    pass


def load_task(cfg: ExperimentConfig, rows=None, log=print):
  """The task of `cfg` with its train.last_step training batches (their `rows` only, if given); a missing or
  malformed data file, or a vocabulary larger than the model's, is a ConfigError."""
  last, B = cfg.train.last_step, cfg.data.batch_size
  try:
    task = make_task(cfg.data, cfg.seed, last, rows)
  except (OSError, ValueError) as e:  # a missing or malformed data file; the message names its config key
    raise ConfigError(str(e)) from None
  if task.vocab_size > cfg.model.vocab_size:
    raise ConfigError(f"config.model.vocab_size {cfg.model.vocab_size} is smaller than the vocabulary of task "
                      f"{task.name!r} ({task.vocab_size})")
  names = evaluate.metric_names(task)
  if cfg.train.early_stop > 0 and cfg.train.early_stop_metric not in names:
    raise ConfigError(f"config.train.early_stop_metric {cfg.train.early_stop_metric!r} is not an eval metric of "
                      f"task {task.name!r}: one of {names}")
  if cfg.train.supervised_head and not task.max_supervised:
    raise ConfigError(f"config.train.supervised_head needs a task that bounds the supervised positions of a row "
                      f"(mqar); task {task.name!r} does not: set it to False")
  if task.train_windows:  # how often a text run sees its data, which decides whether it can overfit
    log(f"data: {last * B:,} training windows of {task.train_windows:,} in the train split "
        f"({last * B / task.train_windows:.2f} epochs)")
  return task


def train(cfg: ExperimentConfig, log=print) -> dict:
  """Trains (or resumes) `cfg` in `cfg.run_dir`; returns the summary also written to summary.json.

  The work directory holds config.json (the resolved config), corpus.json (for token files that gdn-corpus
  built: which build; a relaunch on another is refused), metrics.jsonl, tb/ (TensorBoard), checkpoints/,
  summary.json and the lock files of the run that holds it (gdn/train/workdir.py: a second
  run on it is refused, and so is a config its checkpoints do not fit, unless train.resume says otherwise).
  Several processes (after `jax.distributed.initialize()`) run the same call on a shared work directory: each
  loads its own rows of every batch, process 0 alone writes the files other than checkpoints and logs.
  """
  os.makedirs(cfg.run_dir, exist_ok=True)
  lock = workdirs.Lock(cfg.run_dir, jax.process_index())
  try:
    with cfg.train.precision():
      return _train(cfg, log)
  finally:
    lock.release()


def _train(cfg: ExperimentConfig, log) -> dict:
  workdir = cfg.run_dir
  primary = jax.process_index() == 0
  if not primary:
    log = lambda *a: None
  ckdir = os.path.join(workdir, "checkpoints")
  mode = workdirs.decide(workdir, workdirs.as_json(cfg), workdirs.has_checkpoints(ckdir))
  if mode == "resume" and (done := workdirs.finished_summary(cfg)) is not None:
    # Relaunched after it ended (the same command again, a sweep's next piece): nothing to train or log.
    log(f"{workdir}: finished already at step {done['steps']}"
        f"{' (stopped early)' if done.get('stopped_early') else ''}; its summary.json stands")
    return done
  if mode == "resume":  # checkpoints of another corpus build would go on with other bytes
    workdirs.check_corpus(cfg, workdir, workdirs.has_checkpoints(ckdir))
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
  task = load_task(cfg, rows, log)
  tx = optimizer.make_optimizer(tc)
  lr = optimizer.lr_shape(tc)
  graphdef, state = step.init(cfg.model, tx, cfg.seed)
  n_params = step.num_params(state.params)

  if mode == "params_only":  # read before the old run is moved, so a mismatch leaves it where it was
    old = checkpoint.Checkpoints(ckdir, tc.keep_checkpoints)
    try:
      params, at = old.restore_params(state.params)
    finally:
      old.close()
    state = state.replace(params=params)
    log(f"starting from the parameters of step {at} of the previous run, with a new optimizer state")
  # The config is sound: now the work directory changes hands.
  previous = workdirs.next_previous(workdir)
  _sync("work directory read")  # every process decides before process 0 moves or writes anything
  if mode != "resume":
    if primary:
      workdirs.set_aside(workdir, previous)
    log(f"train.resume={mode}: moved the previous run in {workdir} to {previous}")
  if primary:
    workdirs.write_config(cfg, workdir)
    workdirs.write_corpus(cfg, workdir)
  _sync("work directory ready")

  ckpts = checkpoint.Checkpoints(ckdir, tc.keep_checkpoints)
  restored = None if mode != "resume" else ckpts.restore_latest(state)
  data_state, start = None, 0
  if restored is not None:
    state, data_state, start = restored
    log(f"resumed from step {start} in {workdir}")
  state = sharding.shard_state(state, mesh)
  writer = metrics.MetricWriter(workdir, resume_step=start) if primary else _NoWriter()
  data = iterator(task.train, data_state, num_threads=cfg.data.num_threads)
  # Context parallelism in the train step only: eval runs the plain forward on the same mesh (its batches
  # may have fewer rows than the devices that split the batch, and it needs no gradients).
  supervised = task.max_supervised if cfg.train.supervised_head else 0
  train_step = step.make_train_step(graphdef, tx, lr, mesh=mesh, loss_chunk=cfg.train.loss_chunk,
                                    supervised=supervised)
  eval_step = step.make_eval_step(graphdef, mesh, loss_chunk=cfg.train.loss_chunk, supervised=supervised)
  sets = evaluate.EvalSets(task, cfg.data.eval_batch, cfg.seed)

  def run_eval(s):
    result = evaluate.evaluate(eval_step, state.params, state.rest, sets)
    writer.write(s, "eval", result)
    return result

  final_eval, stopped = None, False
  if restored is not None and 0 < start < last:
    final_eval = _early_stop_logged(workdir, tc, start)  # killed after its early stop's checkpoint
    if final_eval is not None:
      stopped, last = True, start
      log(f"step {start}: eval {tc.early_stop_metric} had reached {tc.early_stop} before the restart; stopped early")
  # Metrics of step s are fetched after step s + 1 is dispatched, so the host never stalls the device; fetching
  # every step also bounds the steps in flight to two (XLA:CPU can deadlock with many queued donated steps).
  pending = None
  window_tokens, window_start = 0, time.perf_counter()
  bar = tqdm.tqdm(total=last, initial=start, disable=not (tc.progress_bar and primary), dynamic_ncols=True,
                  desc=cfg.name)
  t0 = time.perf_counter()
  clock = workdirs.LaunchTimes(workdir, start, t0, write=primary)

  skipped = 0  # steps whose update the train step dropped for a non-finite loss or gradient, this launch

  def flush(pending):
    nonlocal window_tokens, window_start, skipped
    ps, pm, tokens = pending
    pm = {k: float(v) for k, v in jax.device_get(pm).items()}
    window_tokens += tokens  # counted when its step is read, so a window holds exactly the steps it reports
    if pm["nonfinite"] or ps % tc.log_every == 0 or ps == last:
      now = time.perf_counter()
      pm["tokens_per_s"] = window_tokens / max(now - window_start, 1e-9)
      window_tokens, window_start = 0, now
      writer.write(ps, "train", pm)
      bar.set_postfix(loss=f"{pm['loss']:.4f}", tok_s=f"{pm['tokens_per_s']:.0f}")
    if pm["nonfinite"]:
      skipped += 1
      what = f"step {ps}: loss {pm['loss']}, gradient norm {pm['grad_norm']}"
      if skipped > tc.skip_nonfinite:
        kept = ckpts.latest_step()
        raise NonFiniteLoss(f"{nonfinite_stop(what, skipped, tc.skip_nonfinite)}; nothing after the last good "
                            f"checkpoint ({'none yet' if kept is None else f'step {kept}'}) was saved")
      log(f"{what}: not finite, update skipped ({skipped} of config.train.skip_nonfinite={tc.skip_nonfinite})")

  try:
    for s in range(start + 1, last + 1):
      batch = sharding.shard_batch(next(data), mesh, B)
      state, m = train_step(state, batch)
      if pending is not None:
        flush(pending)
      pending = (s, m, batch["inputs"].size)
      bar.update(1)
      evals, saves = due(tc, s, last)
      if evals or saves:  # both wait for the step anyway: read its metrics first, to stop before a bad save
        flush(pending)
        pending = None
      if evals:
        t_eval = time.perf_counter()
        final_eval = run_eval(s)
        log(f"step {s}: {eval_line(final_eval)} (evaluated in {time.perf_counter() - t_eval:.1f} s)")
        stopped = tc.early_stop > 0 and final_eval[tc.early_stop_metric] >= tc.early_stop
      if saves or stopped:
        ckpts.save(s, state, data.get_state())
        clock.mark(s, time.perf_counter())
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

  return summarize(cfg, last, stopped, n_params, clock, final_eval, write=primary)


def _early_stop_logged(workdir: str, tc, step: int):
  """The eval metrics logged at `step` if they reached train.early_stop (a run stopped there and was killed
  before its summary was written), else None."""
  if tc.early_stop <= 0 or not os.path.exists(os.path.join(workdir, "metrics.jsonl")):
    return None
  logged = [r for r in metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
            if r["step"] == step and f"eval/{tc.early_stop_metric}" in r]
  if not logged or logged[-1][f"eval/{tc.early_stop_metric}"] < tc.early_stop:
    return None
  return {k.split("/", 1)[1]: v for k, v in logged[-1].items() if k.startswith("eval/")}


def due(tc, s: int, last: int) -> tuple:
  """(evaluate, checkpoint) after step s: every train.eval_every / checkpoint_every steps, and at the last."""
  return (bool(tc.eval_every and s % tc.eval_every == 0) or s == last,
          bool(tc.checkpoint_every and s % tc.checkpoint_every == 0) or s == last)


def eval_line(result: dict) -> str:
  """The eval metrics averaged over splits, for the log."""
  return ", ".join(f"{k} {v:.4f}" for k, v in sorted(result.items()) if "/" not in k)


def nonfinite_stop(what: str, skipped: int, allowed: int) -> str:
  """Why a run stops at its `skipped`-th non-finite step; what: "step s: loss x, gradient norm y"."""
  return (f"{what}: not finite, stopped ({skipped - 1} such steps skipped before, "
          f"config.train.skip_nonfinite={allowed} allowed)")


def summarize(cfg: ExperimentConfig, steps: int, stopped: bool, n_params: int, clock, final_eval: dict,
              write: bool = True) -> dict:
  """The run's summary, written to summary.json in its work directory if `write`. steps: the steps trained,
  fewer than train.last_step when stopped_early; clock: the run's `workdir.LaunchTimes` (its seconds, this
  launch's and every launch's, are taken now and its last entry written)."""
  now = time.perf_counter()
  clock.mark(steps, now)
  summary = dict(name=cfg.name, workdir=os.path.abspath(cfg.run_dir), steps=steps, stopped_early=stopped,
                 params=n_params, seconds=now - clock.t0, seconds_total=clock.total(now), launches=clock.launches,
                 eval=final_eval)
  if cfg.data.task == "tokens":  # the digests of a gdn-corpus build name the exact bytes trained on
    summary["corpus"] = corpus.describe(cfg.data.text.train_file)
  if write:
    with open(os.path.join(cfg.run_dir, "summary.json"), "w") as f:
      json.dump(summary, f, indent=2)
  return summary
