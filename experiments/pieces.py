"""Run a sweep in budgeted pieces: `python -m experiments.pieces --config C --jobs next --budget 540`.

For a machine held a few minutes at a time (a GPU call of under ten minutes): a queue of jobs, each one (model,
setting) group's cells for one seed or for every seed, cut into the programs that `gdn-compare --stack
--stack-size` trains (at most that many cells each), one process a program (`gdn-compare --cells`), cut by what
the budget has left. A program is not started where it would get less than `--min-left` seconds, or less than
`--fit` times its estimate, taken as the program is about to start: the longest finished program of its group (its
cells' summaries have that program's seconds), else of the sweep, an earlier job of the same command included
(a program cut short keeps only its checkpoints, and those only while
the machine keeps its results/); a later, shorter program may still start. Then the
report is written, which writes each finished cell's record (results/<name>/records/<cell>/), and with
`--archive` the records are packed into one file to carry back; unpacked beside the code and committed, they
are what later pieces skip.

Jobs (the groups in `gdn-compare --list`'s order, as `--shard g/n` counts them):
  g:s      group g (its index, or its model's name; "model/setting" where a config has several settings), seed s
  g:all    every seed of group g
  next     every (group, seed) with a cell left to train, seed by seed: each group's seed 0, then each one's seed 1, ...

`--parallel N` runs up to N jobs at once, each its own process on the same devices, so that one job's start-up
and compilation (about 75 s of a two-cell language-model job's 170 on the H200) overlap another's training;
each job still gets what the budget has left when it starts. Jobs at once share the devices, so a program
that would start beside k running ones is estimated to take k + 1 times its time alone, and so is what is left of
each running one: it starts only where the time left holds all of that, else it waits for a slot to free (two
two-cell S-NIAH programs of about 250-280 s alone, started together on one H100, were both cut at 541 s).

Each job's output goes to results/<name>/runs/pieces/; `--log FILE` appends, per job, its command, the machine,
its exit code (124: cut by the budget) and seconds, and each finished cell's last evaluation. Overrides
(`--config.key=value`) go to every job, and the progress bar is off in them (the log keeps the lines).

  python -m experiments.pieces --config configs/lm_ablations.py --jobs next --budget 540 --min-left 200 \\
      --log results/lm_ablations/card_log.txt --archive "$OUT/records.tgz"
  python -m experiments.pieces --config configs/lm_hybrids.py --jobs next --budget 540 --min-left 200 --parallel 2
  python -m experiments.pieces --config configs/lm_hybrids.py --jobs gdn:0 gdn_h1:0 --budget 540 --dry-run
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time

from gdn.sweep import done, expand, groups
from gdn.sweep.grid import stacks, summary, tuning_seeds
from gdn.train import ConfigError
from gdn.train.config_file import apply_overrides, load, split_argv

CUT = 124  # the exit code of a job the budget cut, as `timeout` gives it


def group_labels(cells) -> list:
  """Each group's name: its model's, or "model/setting" where the sweep has several settings."""
  gs = groups(cells)
  several = len({g[0].setting for g in gs}) > 1
  return [f"{g[0].model}/{g[0].setting}" if several else g[0].model for g in gs]


def plan(cells, jobs) -> list:
  """(group index, seed or None for every seed) per job, in order; "next" expands to every (group, seed) with a
  cell left to train, seed by seed; in a sweep with `sweep.tune_seeds`, to the tuning seeds' jobs that way and
  then one job per group for its other seeds' cells (one rate each, stacked together), where the tuning has
  picked their rate. Jobs with nothing left to train are dropped."""
  gs, labels = groups(cells), group_labels(cells)
  seeds = list(dict.fromkeys(c.seed for c in cells))
  tuning = set(tuning_seeds(cells[0].config.sweep)) if cells else set()
  out = []
  for job in jobs:
    if job == "next":
      out += [(g, s) for s in seeds if not tuning or s in tuning for g in range(len(gs))
              if any(c.seed == s and not done(c) for c in gs[g])]
      if tuning:
        out += [(g, None) for g in range(len(gs)) if any(c.seed not in tuning and not done(c) for c in gs[g])]
      continue
    name, sep, seed = job.rpartition(":")
    if not sep or not name:
      raise ConfigError(f"a job is g:s, g:all or next, got {job!r}")
    if name.isdigit() and int(name) < len(gs):
      g = int(name)
    elif name in labels:
      g = labels.index(name)
    else:
      raise ConfigError(f"job {job!r}: no group {name!r}; the groups are 0-{len(gs) - 1}: {', '.join(labels)}")
    if seed == "all":
      s = None
    elif seed.lstrip("-").isdigit() and int(seed) in seeds:
      s = int(seed)
    else:
      raise ConfigError(f"job {job!r}: the seed must be one of {seeds} or 'all', got {seed!r}")
    out.append((g, s))
  left = [(g, s) for g, s in dict.fromkeys(out) if any(not done(c) for c in gs[g] if s is None or c.seed == s)]
  return left


def programs(cells, jobs, stack_size: int) -> list:
  """The plan's jobs cut into one job per stacked program: (group, seed or None, the program's cell ids), as
  `gdn-compare --stack --stack-size` would cut each job's cells left (`gdn.sweep.grid.stacks`: a program with
  checkpoints first, as it was). One program a process, so that `--min-left` and the estimate gate each
  program, and a program the budget cannot hold is not begun behind one that it can."""
  gs, out = groups(cells), []
  for g, s in jobs:  # (g, None): every cell left (a tuned sweep lists its other seeds once the tuning finished)
    mine = [c for c in gs[g] if s is None or c.seed == s]
    out += [(g, s, tuple(c.id for c in piece)) for piece in stacks(mine, stack_size)]
  return out


def estimate(cells, g: int):
  """Seconds a program of group g is expected to take: the longest that any of its finished cells' programs
  took over all their launches (a stacked program's seconds are in each of its cells' summaries), else the
  longest of any group's;
  None where no cell of the sweep has finished."""
  # A program resumed from checkpoints: its seconds over every launch (seconds_total), not the last launch's.
  took = lambda x: x.get("seconds_total", x.get("seconds"))
  seconds = lambda group: [float(took(x)) for x in map(summary, group) if x and took(x) is not None]
  gs = groups(cells)
  own = seconds(gs[g])
  if own:
    return max(own)
  every = [t for group in gs for t in seconds(group)]
  return max(every) if every else None


# A job that has started: its process, when it started, its deadline and timeout, and its estimate alone (or None).
Running = collections.namedtuple("Running", "name shown path proc start deadline timeout estimate")


def shared_need(secs: float, running_left) -> float:
  """Seconds that a program estimated at `secs` alone needs if it starts beside programs with `running_left`
  seconds of their own estimates left (None where a program has none): k + 1 programs on the same devices each
  run at about 1/(k + 1) of their speed alone, the new one and the running ones alike."""
  share = len(running_left) + 1
  return share * max([secs] + [x for x in running_left if x is not None])


def job_command(spec: str, overrides, g: int, num_groups: int, seed, stack_size: int, ids=()) -> list:
  cmd = [sys.executable, "-m", "experiments.compare", "--config", spec, *(f"--config.{o}" for o in overrides),
         "--config.train.progress_bar=false"]
  if seed is not None:
    cmd.append(f"--config.sweep.seeds=({seed},)")
  cmd += ["--stack", "--stack-size", str(stack_size), "--shard", f"{g}/{num_groups}"]
  return cmd + (["--cells", ",".join(ids)] if ids else [])


def start_job(cmd, log_path: str, env=None) -> subprocess.Popen:
  """The job's process, in a process group of its own, its output to `log_path`."""
  with open(log_path, "w") as f:
    return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=env)


def stop_job(proc: subprocess.Popen) -> int:
  """Stops the job's process group (SIGTERM, then SIGKILL after 20 s); CUT."""
  for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, None)):
    try:
      os.killpg(proc.pid, sig)
      proc.wait(timeout=wait)
      break
    except (ProcessLookupError, subprocess.TimeoutExpired):
      continue
  return CUT


def summary_lines(log_path: str, last_step: int) -> list:
  """What the piece log keeps of a job's output: the stacked programs, the data line, each cell's evaluation at
  its last step and any error."""
  keep = re.compile(rf"^\[\d+/\d+\]|^data:|: step {last_step}: |error|Error")
  with open(log_path, errors="replace") as f:
    return [line.rstrip() for line in f if keep.search(line)]


def machine() -> str:
  """The accelerators this process would use, in words (nvidia-smi's names), or the CPU."""
  if shutil.which("nvidia-smi"):
    try:
      names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.split("\n")
      names = [n.strip() for n in names if n.strip()]
      if names:
        return ("one " if len(names) == 1 else f"{len(names)} x ") + names[0]
    except (OSError, subprocess.SubprocessError):
      pass
  return f"CPU, {os.cpu_count()} cores"


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  p = argparse.ArgumentParser(prog="gdn-pieces",
                              usage="gdn-pieces --config FILE.py[:ARG] [--config.KEY=VALUE ...] [options]",
                              description=__doc__.split("\n")[0])
  p.add_argument("--jobs", nargs="+", default=["next"], help="g:s, g:all or next (see above)")
  p.add_argument("--budget", type=float, required=True, help="seconds for all the jobs, from this command's start")
  p.add_argument("--min-left", type=float, default=0.0,
                 help="do not start a job that would get fewer seconds than this")
  p.add_argument("--reserve", type=float, default=30.0,
                 help="seconds of the budget kept for the report and the archive after the last job")
  p.add_argument("--stack-size", type=int, default=3, help="at most this many cells a program (0: a job's all)")
  p.add_argument("--parallel", type=int, default=1,
                 help="jobs run at once, each its own process on the same devices (one job's start-up and "
                 "compilation then overlap another's training; a job starts beside k others only where the time "
                 "left holds k + 1 times its estimate and theirs); with more than one, XLA_PYTHON_CLIENT_PREALLOCATE "
                 "is false in the jobs unless set")
  p.add_argument("--log", help="append each job's command, exit code, seconds and last evaluations to this file")
  p.add_argument("--archive", help="pack results/<name>/records/ into this .tgz after the report")
  p.add_argument("--fit", type=float, default=1.1,
                 help="do not start a program where the time left is under this times its estimate: the longest "
                      "finished program of its group (each cell's summary has its program's seconds), or of the "
                      "sweep where its group has none; 0: no estimate")
  p.add_argument("--dry-run", action="store_true", help="print the jobs' commands and estimates and exit")
  try:
    spec, overrides, rest = split_argv(argv)
    a = p.parse_args(rest)
    if not spec:
      raise ConfigError("--config is required (e.g. --config configs/lm_ablations.py)")
    if a.stack_size < 0:
      raise ConfigError(f"--stack-size must be >= 0, got {a.stack_size}")
    if a.parallel < 1:
      raise ConfigError(f"--parallel must be >= 1, got {a.parallel}")
    config = apply_overrides(load(spec), overrides)
    cells = expand(config)
    jobs = programs(cells, plan(cells, a.jobs), a.stack_size)
    if a.fit < 0:
      raise ConfigError(f"--fit must be >= 0, got {a.fit:g}")
  except (ConfigError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  t0 = time.monotonic()
  out_dir = os.path.join("results", config.name)
  labels, n = group_labels(cells), len(groups(cells))
  last_step = cells[0].config.train.last_step if cells else 0
  counts, seen, names = collections.Counter((g, s) for g, s, _ in jobs), collections.Counter(), []
  for g, s, _ in jobs:  # "gdn:0", or "gdn:0 [1/2]" where the job's cells make several programs
    seen[g, s] += 1
    names.append(f"{labels[g]}:{'all' if s is None else s}"
                 + (f" [{seen[g, s]}/{counts[g, s]}]" if counts[g, s] > 1 else ""))
  print(f"{len(jobs)} job(s) with cells left: " + ", ".join(names))
  if a.dry_run:
    for name, (g, s, ids) in zip(names, jobs):
      secs = estimate(cells, g) if a.fit else None
      print(f"# {name}: {len(ids)} cell(s)" + (f", about {secs:.0f} s (its group's finished programs, or the "
                                                  f"sweep's)" if secs else ""))
      print(shlex.join(job_command(spec, overrides, g, n, s, a.stack_size, ids)))
    return 0
  where, day = machine(), datetime.date.today().isoformat()
  log_dir = os.path.join(out_dir, "runs", "pieces")
  os.makedirs(log_dir, exist_ok=True)
  env = None
  if a.parallel > 1 and "XLA_PYTHON_CLIENT_PREALLOCATE" not in os.environ:
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")  # else each job would take most of a GPU
  piece_log, failed = [], False
  queue = list(zip(names, jobs))
  running = []  # Running
  waiting = set()  # jobs told to wait for a slot (said once)
  while queue or running:
    while queue and len(running) < a.parallel:  # start jobs while a slot is free and the budget holds one
      now = time.monotonic()
      left = a.budget - a.reserve - (now - t0)
      if left < max(a.min_left, 1.0):
        for name, _ in queue:
          print(f"job {name}: not started, {left:.0f} s left (--min-left {a.min_left:g})")
        queue = []
        break
      name, (g, s, ids) = queue.pop(0)
      # Estimated now, not when the command began: a program that finished earlier in this command counts.
      secs = estimate(cells, g) if a.fit else None
      if secs and left < a.fit * secs:  # the time left only shrinks: a later, shorter program may still fit
        print(f"job {name}: not started, {left:.0f} s left, about {secs:.0f} s needed (--fit {a.fit:g} x the "
              f"longest finished program of its group, or of the sweep)")
        continue
      if secs and running:
        need = shared_need(secs, [None if r.estimate is None else max(0.0, r.estimate - (now - r.start))
                                  for r in running])
        if left < a.fit * need:  # it fits alone: wait until the running jobs end, then estimate again
          if name not in waiting:
            print(f"job {name}: waits, {left:.0f} s left, about {need:.0f} s needed beside {len(running)} running "
                  f"(each at 1/{len(running) + 1} of its speed alone)", flush=True)
            waiting.add(name)
          queue.insert(0, (name, (g, s, ids)))
          break
      cmd = job_command(spec, overrides, g, n, s, a.stack_size, ids)
      shown = shlex.join(["python"] + cmd[1:])
      print(f"job {name}: {shown} (up to {left:.0f} s)", flush=True)
      stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
      tag = re.sub(r"[^\w.-]+", "_", name)
      path = os.path.join(log_dir, f"{stamp}_{tag}.log")
      start = time.monotonic()
      running.append(Running(name, shown, path, start_job(cmd, path, env), start, start + left, left, secs))
    for job in list(running):  # finish the jobs that have ended or run out of time
      name, shown, path, proc, start, deadline, timeout, _ = job
      rc = proc.poll()
      if rc is None and time.monotonic() < deadline:
        continue
      rc = stop_job(proc) if rc is None else rc
      running.remove(job)
      secs = time.monotonic() - start
      failed |= rc not in (0, CUT)
      lines = [f"# {shown} ({day}, {where}, timeout {timeout:.0f} s)", f"job {name} rc={rc} {secs:.0f}s",
               *summary_lines(path, last_step)]
      piece_log += lines
      print("\n".join(lines[1:]) + ("" if rc in (0, CUT) else f"\n(the job's output: {path})"), flush=True)
    if running:
      time.sleep(0.2)
  report = subprocess.run([sys.executable, "-m", "experiments.compare", "--config", spec,
                           *(f"--config.{o}" for o in overrides), "--report"], capture_output=True, text=True)
  records_dir = os.path.join(out_dir, "records")
  now = expand(config)  # a tuned sweep lists more cells once its tuning seeds have finished
  finished = sum(done(c) for c in now)
  print(f"report: {out_dir}/table.md ({finished} of {len(now)} cells done)" if report.returncode == 0
        else f"report: none ({report.stderr.strip().splitlines()[-1] if report.stderr.strip() else report.returncode})")
  if a.log and piece_log:
    with open(a.log, "a") as f:
      f.write("\n".join(piece_log) + "\n")
  if a.archive and os.path.isdir(records_dir):
    with tarfile.open(a.archive, "w:gz") as tar:
      tar.add(records_dir, arcname=records_dir)
    print(f"archive: {a.archive} (unpack beside the code: tar xzf {os.path.basename(a.archive)})")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
