"""One train step of a config's model on its own task's first batch, with `train.supervised_head` off and on.

`train.supervised_head` applies the output head and the loss at each row's supervised positions only (at most the
task's `max_supervised`: MQAR's pairs), which gives the same loss and gradients (tests/test_supervised_head.py).
This prints what it saves: the step's median time and XLA's memory estimate (arguments + outputs + temporaries)
for both, side by side in one process.

  python -m experiments.bench_supervised_head --config configs/mqar_zoology.py:d128 --setting T256_P16_d128 \\
      --override data.batch_size=64
"""

from __future__ import annotations

import argparse

import jax

from gdn.bench.timing import compiled_bytes, timed
from gdn.train import optimizer, step
from gdn.train.config_file import resolve
from gdn.train.loop import load_task


def config(spec: str, setting: str | None, overrides) -> object:
  """The config of `spec` with one sweep setting's overrides (a key of its sweep.settings) and `overrides`."""
  cfg = resolve(spec, ())
  extra = ()
  if setting is not None:
    settings = dict(cfg.sweep.settings)
    if setting not in settings:
      raise SystemExit(f"--setting: {spec} has no sweep setting {setting!r} (it has {', '.join(settings)})")
    extra = tuple(settings[setting])
  return resolve(spec, extra + tuple(overrides))


def measure(cfg, task, reps: int) -> list:
  """One row per head: at every position, at the task's `max_supervised` positions a row."""
  batch = jax.device_put(task.train[0])
  tx = optimizer.make_optimizer(cfg.train)
  rows = []
  for supervised in (0, task.max_supervised):
    graphdef, state = step.init(cfg.model, tx, cfg.seed)
    fn = step.make_train_step(graphdef, tx, optimizer.lr_shape(cfg.train), supervised=supervised)
    compiled = fn.lower(state, batch).compile()
    holder = [state]

    def one():
      holder[0], m = compiled(holder[0], batch)  # the state is donated: feed each step the last one's
      return m

    ms = timed(one, (), reps)
    rows.append(dict(supervised=supervised, ms=ms, bytes=compiled_bytes(compiled)))
  return rows


def main(argv=None) -> list:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", default="configs/mqar_zoology.py:d128", help="a config file spec (FILE.py[:ARG])")
  p.add_argument("--setting", help="one of the config's sweep settings (default: the config as it is)")
  p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE")
  p.add_argument("--reps", type=int, default=5)
  a = p.parse_args(argv)
  cfg = config(a.config, a.setting, a.override)
  task = load_task(cfg, log=lambda *a: None)
  T = task.train[0]["inputs"].shape[1]
  if not 0 < task.max_supervised < T:
    raise SystemExit(f"--config: task {cfg.data.task!r} bounds its supervised positions at {task.max_supervised} "
                     f"a row (0: no bound), not below the first batch's length {T}: nothing to compare")
  rows = measure(cfg, task, a.reps)
  B = cfg.data.batch_size
  print(f"# one train step, {a.config}" + (f" {a.setting}" if a.setting else "") + f", batch {B}, "
        f"{jax.devices()[0].device_kind}, jax {jax.__version__}; median of {a.reps}")
  print("| head at | ms / step | XLA memory MiB | time / all | memory / all |")
  print("|---|---:|---:|---:|---:|")
  base = rows[0]
  for r in rows:
    where = "every position" if not r["supervised"] else f"{r['supervised']} supervised positions a row"
    mib = "-" if r["bytes"] is None else f"{r['bytes'] / 2**20:.1f}"
    mem = "-" if r["bytes"] is None or base["bytes"] is None else f"{r['bytes'] / base['bytes']:.2f}"
    print(f"| {where} | {r['ms']:.2f} | {mib} | {r['ms'] / base['ms']:.2f} | {mem} |")
  return rows


if __name__ == "__main__":
  main()
