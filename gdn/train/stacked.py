"""Several cells of a sweep trained as one program: cells that differ only in seed and learning rate, stacked
along a leading axis N of the parameters, optimizer states, batches and rates (`jax.vmap` of the train step).

Tiny models (2-layer MQAR or state tracking, d_model 64-512) leave a GPU idle between their small kernels
when each cell runs in its own process; one stacked program launches every cell's kernels at once.

A cell trains as `train` would train it: the same initial parameters and batches (its seed) and the same
optimizer, its peak rate held in its optimizer state (gdn/train/optimizer.py), so one compiled step serves every
rate. It stops early at the first evaluation that reaches train.early_stop, and more than train.skip_nonfinite
non-finite steps stop it without a summary (as `gdn.sweep.grid.run_cells` leaves a cell that raises
NonFiniteLoss). A cell that has ended is frozen (its updates masked off) and keeps its slot until half or more
of the program's cells have ended; then the cells still training are stacked again as a smaller program (SHRINK),
so that a group whose fast cells stop early does not pay for them until its slowest cell ends.

Each cell keeps its run directory with the files `train` writes there (config.json, metrics.jsonl, tb/,
summary.json), so sweeps and their reports read stacked cells as they read the others. The checkpoints are the
group's, in `<the runs' directory>/.stacked/<hash of the cell names>/checkpoints`: the stacked state, every
cell's data position, and which cells non-finite steps stopped (they stay stopped when the group resumes).
One process, on its default device: a mesh of several devices is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from gdn.data import iterator
from gdn.train import checkpoint, evaluate, metrics, optimizer, step, workdir as workdirs
from gdn.train.config import ConfigError, ExperimentConfig
from gdn.train.loop import due, eval_line, load_task, nonfinite_stop, summarize

# The config keys in which the cells of one group may differ.
PER_CELL = ("name", "workdir", "seed", "train.learning_rate")
# True: once half or more of the running program's cells have ended, the others are stacked again as a program
# of their own (one more compile for each halving); the group's checkpoints keep every cell's state either way.
SHRINK = True


def check(cfgs) -> None:
  """Raises ConfigError unless `cfgs` can train as one program: configs that differ in PER_CELL keys alone,
  distinct work directories, one process on one device, no train.resume='params_only'."""
  if not cfgs:
    raise ConfigError("stacked training needs at least one config")
  first = workdirs.flat(workdirs.as_json(cfgs[0]))
  for cfg in cfgs[1:]:
    other = workdirs.flat(workdirs.as_json(cfg))
    keys = sorted(k for k in first.keys() | other.keys() if k not in PER_CELL and first.get(k) != other.get(k))
    if keys:
      raise ConfigError(f"stacked cells may differ only in {', '.join(PER_CELL)}: {cfg.name!r} differs from "
                        f"{cfgs[0].name!r} in " + ", ".join(f"config.{k}" for k in keys))
  dirs = [os.path.abspath(c.run_dir) for c in cfgs]
  if len(set(dirs)) < len(dirs):
    raise ConfigError("stacked cells need one work directory each; two or more share one")
  tc = cfgs[0].train
  if jax.process_count() > 1:
    raise ConfigError(f"stacked training runs in one process; this run has {jax.process_count()}")
  if tc.mesh_fsdp > 1 or tc.mesh_seq > 1 or tc.mesh_data > 1:
    raise ConfigError("stacked training runs on one device: config.train.mesh_data, mesh_fsdp and mesh_seq "
                      f"must be 1 (or mesh_data -1), got {tc.mesh_data}, {tc.mesh_fsdp}, {tc.mesh_seq}")
  if tc.resume == "params_only":
    raise ConfigError("config.train.resume='params_only' is not supported by stacked training")


def group_dir(cfgs) -> str:
  """`<the first cell's runs directory>/.stacked/<16 hex digits of SHA-256 of the cell names in order>`."""
  digest = hashlib.sha256("\n".join(c.name for c in cfgs).encode()).hexdigest()[:16]
  return os.path.join(os.path.dirname(os.path.abspath(cfgs[0].run_dir)), ".stacked", digest)


def shared_iterators(tasks, positions, cfgs, active) -> list:
  """Each active cell's training iterator (None for the others), one per distinct stream: cells whose data
  config, seed and data position are the same (a group's cells at several rates of one seed) draw the same
  batches, so they share one iterator, and a step draws each stream's batch once. A stacked group's host time a
  step is then one batch per seed, not per cell (12 cells of 3 seeds: a quarter)."""
  out, by_stream = [], {}
  for t, p, c, a in zip(tasks, positions, cfgs, active):
    if not a:
      out.append(None)
      continue
    key = (repr(c.data), c.seed, c.train.last_step, json.dumps(p, sort_keys=True, default=repr))
    if key not in by_stream:
      by_stream[key] = iterator(t.train, p, num_threads=c.data.num_threads)
    out.append(by_stream[key])
  return out


def train_stacked(cfgs: list, log=print) -> list:
  """Trains (or resumes) the cells `cfgs` as one program; returns their summaries in order (each also written
  to the cell's summary.json), None for a cell that non-finite steps stopped. A cell that has finished already
  (`workdir.finished`) is not trained again: its summary is read back."""
  check(cfgs)
  if all(workdirs.finished(c) for c in cfgs):
    return [_read_summary(c) for c in cfgs]
  gdir = group_dir(cfgs)
  os.makedirs(gdir, exist_ok=True)
  locks = [workdirs.Lock(gdir)]
  try:
    for cfg in cfgs:
      if not workdirs.finished(cfg):
        os.makedirs(cfg.run_dir, exist_ok=True)
        locks.append(workdirs.Lock(cfg.run_dir))
    with cfgs[0].train.precision():  # the same in every cell (`check`)
      return _train_stacked(cfgs, gdir, log)
  finally:
    for lock in locks:
      lock.release()


def _read_summary(cfg: ExperimentConfig) -> dict:
  with open(os.path.join(cfg.run_dir, "summary.json")) as f:
    return json.load(f)


def _stack(batches: list, moe: bool) -> dict:
  """The cells' batches as one [N, B, T] batch; an ended cell's (None) is all zeros, whose zero weights give
  a zero loss and gradient. Batches of different lengths (a length mixture) are padded at the end with
  zero-weight positions, which a causal model's loss does not see (up to rounding)."""
  ref = next(b for b in batches if b is not None)
  T = max(b["inputs"].shape[1] for b in batches if b is not None)
  if moe and any(b is not None and b["inputs"].shape[1] != T for b in batches):
    raise ConfigError("stacked cells drew batches of different lengths, and padding them would change the MoE "
                      "layers' load-balancing loss: train these cells without stacking")
  pad = lambda x: np.pad(x, [(0, 0), (0, T - x.shape[1])] + [(0, 0)] * (x.ndim - 2))
  return {k: np.stack([pad(b[k]) if b is not None else np.zeros((v.shape[0], T) + v.shape[2:], v.dtype)
                       for b in batches]) for k, v in ref.items()}


def _cell(tree, i: int):
  return jax.tree.map(lambda x: x[i], tree)


def _take(tree, rows: list):
  """The rows `rows` of every leaf's leading (cell) axis."""
  return jax.tree.map(lambda x: x[np.asarray(rows)], tree)


def _put(tree, rows: list, part):
  """`tree` with its rows `rows` replaced by `part`'s."""
  return jax.tree.map(lambda x, y: x.at[np.asarray(rows)].set(y), tree, part)


def _train_stacked(cfgs: list, gdir: str, log) -> list:
  N, cfg0 = len(cfgs), cfgs[0]
  tc, last = cfg0.train, cfg0.train.last_step
  ckdir = os.path.join(gdir, "checkpoints")
  mode = workdirs.decide(gdir, workdirs.as_json(cfg0), workdirs.has_checkpoints(ckdir))
  if mode == "resume":
    workdirs.check_corpus(cfg0, gdir, workdirs.has_checkpoints(ckdir))
  ended = [workdirs.finished(c) for c in cfgs]  # finished before this launch: frozen throughout
  for cfg, e in zip(cfgs, ended):
    if not e and mode == "resume" and workdirs.has_checkpoints(os.path.join(cfg.run_dir, "checkpoints")):
      raise ConfigError(f"{cfg.run_dir} holds the checkpoints of a run trained on its own (gdn-train, or "
                        "gdn-compare without --stack): finish it that way, or move that directory away to train "
                        "the cell stacked")
  tasks = [load_task(c, log=log if i == 0 else lambda *a: None) for i, c in enumerate(cfgs)]

  tx = optimizer.make_optimizer(tc)
  graphdefs = []

  def init(key):
    graphdef, state = step.init(cfg0.model, tx, key)
    graphdefs.append(graphdef)
    return state

  # Unjitted, as `train` initialises: vmap draws each cell's numbers from its own key, as `step.init` does.
  state = jax.vmap(init)(jax.vmap(jax.random.key)(jnp.asarray([c.seed for c in cfgs])))
  rates = jnp.asarray([c.train.learning_rate for c in cfgs], jnp.float32)
  state = state.replace(opt_state=optimizer.with_peak_lr(state.opt_state, rates))
  graphdef, n_params = graphdefs[0], step.num_params(state.params) // N

  if mode != "resume":  # "fresh": this group's checkpoints and its unfinished cells' runs are set aside
    for d in [gdir] + [c.run_dir for c, e in zip(cfgs, ended) if not e]:
      previous = workdirs.next_previous(d)
      workdirs.set_aside(d, previous)
      log(f"train.resume={mode}: moved the previous run in {d} to {previous}")
  workdirs.write_config(cfg0, gdir)
  workdirs.write_corpus(cfg0, gdir)
  with open(os.path.join(gdir, "cells.json"), "w") as f:
    json.dump([c.name for c in cfgs], f, indent=2)
  for cfg, e in zip(cfgs, ended):
    if not e:
      workdirs.write_config(cfg, cfg.run_dir)

  ckpts = checkpoint.Checkpoints(ckdir, tc.keep_checkpoints)
  restored = None if mode != "resume" else ckpts.restore_latest(state)
  positions, failed, start = [None] * N, [False] * N, 0
  if restored is not None:
    state, data_state, start = restored
    positions, failed = data_state["positions"], data_state["failed"]
    log(f"resumed {N} stacked cells from step {start} in {gdir}")
  active = [not (e or f) for e, f in zip(ended, failed)]
  summaries = [_read_summary(c) if e else None for c, e in zip(cfgs, ended)]
  if not any(active):
    ckpts.close()
    return summaries

  writers = [metrics.MetricWriter(c.run_dir, resume_step=start) if a else None for c, a in zip(cfgs, active)]
  data = shared_iterators(tasks, positions, cfgs, active)
  moe = "moe" in cfg0.model.mlp_kinds
  supervised = max(t.max_supervised for t in tasks) if tc.supervised_head else 0
  one_step = step.train_step_fn(graphdef, tx, optimizer.lr_shape(tc), loss_chunk=tc.loss_chunk,
                                supervised=supervised)

  def masked_step(state, batch, on):
    new, m = one_step(state, batch)
    return jax.tree.map(lambda a, b: jnp.where(on, a, b), new, state), m

  train_step = jax.jit(jax.vmap(masked_step), donate_argnums=0)
  eval_step = jax.jit(jax.vmap(step.eval_step_fn(graphdef, loss_chunk=tc.loss_chunk, supervised=supervised)))
  sets = [evaluate.EvalSets(t, c.data.eval_batch, c.seed) for t, c in zip(tasks, cfgs)]
  splits = tasks[0].evals
  eval_batches = {}  # split name -> the running cells' eval batches, stacked
  # The running program trains the cells `rows` (indices into cfgs, in order), and `state` holds their rows
  # only; `whole` is every cell's state while it runs a subset (the other cells' rows as they ended), else None.
  rows, whole = list(range(N)), None

  def group_state():
    """Every cell's state, in cfgs' order: what the group's checkpoints hold."""
    return state if whole is None else _put(whole, rows, state)

  def shrink():
    """Once half or more of the running cells have ended, the rest as a program of their own (SHRINK)."""
    nonlocal state, rows, whole
    keep = [j for j, i in enumerate(rows) if active[i]]
    if not SHRINK or not keep or len(keep) > len(rows) // 2:
      return
    whole = group_state()
    state, rows = _take(state, keep), [rows[j] for j in keep]
    eval_batches.clear()
    log(f"{len(rows)} of {N} stacked cells still training: stacked again as a program of {len(rows)}")

  def run_eval(s) -> dict:
    """{cell: its eval metrics} for the active cells, written to their metrics."""
    for split in splits:
      if split.name not in eval_batches:
        eval_batches[split.name] = [_stack(list(b), moe) for b in zip(*(sets[i].batches(split) for i in rows))]
    sums = {split.name: evaluate.add(eval_step(state.params, state.rest, b) for b in eval_batches[split.name])
            for split in splits}
    out = {}
    for j, i in enumerate(rows):
      if active[i]:
        out[i] = evaluate.metrics(tasks[i], {name: _cell(s_, j) for name, s_ in sums.items()})
        writers[i].write(s, "eval", out[i])
    return out

  def stop(i):
    active[i] = False
    writers[i].close()
    writers[i] = None

  def end(i, s, stopped, result):
    summaries[i] = summarize(cfgs[i], s, stopped, n_params, clocks[i], result)
    stop(i)

  def data_state():
    return dict(positions=[it.get_state() if it is not None else p for it, p in zip(data, positions)],
                failed=list(failed))

  bar = tqdm.tqdm(total=last, initial=start, disable=not tc.progress_bar, dynamic_ncols=True,
                  desc=f"{N} stacked cells")
  t0 = time.perf_counter()
  clocks = [workdirs.LaunchTimes(c.run_dir, start, t0) for c in cfgs]  # each cell's seconds over launches
  # Per cell, as `train` keeps them for its run: tokens since its last logged step, and when that was.
  window_tokens, window_start = [0] * N, [t0] * N
  skipped = [0] * N  # steps whose update a non-finite loss or gradient dropped, this launch

  def flush(pending):
    ps, pm, on, prows, tokens = pending
    pm = jax.device_get(pm)
    now = time.perf_counter()
    for j, i in ((j, i) for j, i in enumerate(prows) if on[j] and not failed[i]):
      window_tokens[i] += tokens[j]  # counted when its step is read, so a window holds exactly the steps it reports
      m = {k: float(v[j]) for k, v in pm.items()}
      if m["nonfinite"] or ps % tc.log_every == 0 or ps == last:
        m["tokens_per_s"] = window_tokens[i] / max(now - window_start[i], 1e-9)
        window_tokens[i], window_start[i] = 0, now
        writers[i].write(ps, "train", m)
      if m["nonfinite"]:
        skipped[i] += 1
        what = f"{cfgs[i].name}: step {ps}: loss {m['loss']}, gradient norm {m['grad_norm']}"
        if skipped[i] > tc.skip_nonfinite:
          log(f"{nonfinite_stop(what, skipped[i], tc.skip_nonfinite)}; the cell is frozen, has no summary and "
              "stays stopped when the group resumes")
          failed[i] = True
          stop(i)
        else:
          log(f"{what}: not finite, update skipped ({skipped[i]} of config.train.skip_nonfinite="
              f"{tc.skip_nonfinite})")

  pending, saved = None, start
  s = start
  try:
    shrink()  # cells that ended before this launch
    for s in range(start + 1, last + 1):
      on = np.asarray([active[i] for i in rows])
      drawn, batches = {}, []  # one batch per iterator and step: cells that share an iterator share its batch
      for i in rows:
        if active[i] and id(data[i]) not in drawn:
          drawn[id(data[i])] = next(data[i])
        batches.append(drawn[id(data[i])] if active[i] else None)
      tokens = [0 if b is None else b["inputs"].size for b in batches]
      state, m = train_step(state, _stack(batches, moe), on)
      if pending is not None:
        flush(pending)
      pending = (s, m, on, rows, tokens)
      bar.update(1)
      evals, saves = due(tc, s, last)
      if evals or saves:  # both wait for the step anyway: read its metrics first, to stop before a bad save
        flush(pending)
        pending = None
      stopped = False
      if evals:
        t_eval = time.perf_counter()
        results = run_eval(s)
        took = f" (the {len(results)} evaluated in {time.perf_counter() - t_eval:.1f} s)"
        for i, result in results.items():
          log(f"{cfgs[i].name}: step {s}: {eval_line(result)}{took}")
          reached = tc.early_stop > 0 and result[tc.early_stop_metric] >= tc.early_stop
          if reached:
            log(f"{cfgs[i].name}: step {s}: eval {tc.early_stop_metric} reached {tc.early_stop}; stopping early")
          if reached or s == last:  # the summary first: a kill before the save below leaves the cell finished
            end(i, s, reached, result)
            stopped = True
      if saves or stopped:
        ckpts.save(s, group_state(), data_state())
        saved = s
        for i in (i for i in rows if active[i]):
          clocks[i].mark(s, time.perf_counter())
      if not any(active):  # every cell stopped early or failed before the last step
        break
      shrink()
    if pending is not None:
      flush(pending)
    if s > saved:  # the cells ended by non-finite steps: keep that, so that a relaunch does not train them again
      ckpts.save(s, group_state(), data_state())
    if any(active):  # resumed at the last step: nothing left to train
      for i, result in run_eval(last).items():
        end(i, last, False, result)
  finally:
    bar.close()
    ckpts.close()
    for w in writers:
      if w is not None:
        w.close()
  return summaries
