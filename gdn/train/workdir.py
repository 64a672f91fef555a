"""The work directory of a run: its lock, and whether a new config may continue the checkpoints it holds.

A run holds an exclusive `fcntl` lock on `lock.<process index>` in its work directory for its whole life, so
a second run on the same directory (the same command launched twice, a sweep shard run twice) stops at once
instead of interleaving checkpoints with the first. Every process of a multi-process run locks its own file:
a second multi-process launch is then refused in every one of its processes, not only in process 0.

`config.json` records the config that wrote the checkpoints. A new config continues them only if it differs
in the keys of `RESUMABLE` alone; anything else (the model, the data, the optimizer's numbers, the seed) is a
`ConfigMismatch` naming every differing key, unless `train.resume` asks for "fresh" or "params_only".
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket

from gdn.data import corpus
from gdn.train.checkpoint import ConfigMismatch
from gdn.train.config import ExperimentConfig, to_dict

# Keys a resumed run may change: the run's length and cadence, how it shows progress, where it lives, and the
# sweep that generated it. The learning rate and AdamW's numbers are not among them: they live in the
# optimizer state (`optimizer.make_optimizer`), so a new value would be silently ignored; changing them
# takes train.resume="params_only". train.steps changes the cosine schedule from the current step on.
RESUMABLE = ("name", "workdir", "compilation_cache", "sweep", "data.num_threads", "data.eval_batch_size",
             "train.steps", "train.stop_step", "train.log_every", "train.eval_every", "train.checkpoint_every",
             "train.keep_checkpoints", "train.progress_bar", "train.resume", "train.skip_nonfinite",
             "train.supervised_head")
# What a run writes into its work directory besides the lock; "fresh" and "params_only" move it aside.
RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "launches.json", "tb", "checkpoints",
             "corrupt_checkpoints")


class WorkdirLocked(RuntimeError):
  """Another live run holds the work directory."""


class Lock:
  """An exclusive lock on `<workdir>/lock.<process>` holding the owner's PID and host; released by `release`
  or at exit (the kernel drops an `fcntl` lock with its process, so a killed run leaves nothing to clean up)."""

  def __init__(self, workdir: str, process: int = 0):
    self.path = os.path.join(workdir, f"lock.{process}")
    self._file = open(self.path, "a+")
    try:
      fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      self._file.seek(0)
      holder = self._file.read().strip() or "unknown"
      self._file.close()
      raise WorkdirLocked(f"work directory {workdir} is in use by another run (pid {holder}, lock {self.path}); "
                          "wait for it to finish or choose another config.workdir") from None
    self._file.truncate(0)
    self._file.write(f"{os.getpid()} on host {socket.gethostname()}\n")
    self._file.flush()

  def release(self) -> None:
    if not self._file.closed:
      fcntl.flock(self._file, fcntl.LOCK_UN)
      self._file.close()


def as_json(cfg) -> dict:
  """The config as written to config.json (tuples as lists), for comparing with a saved one."""
  return json.loads(json.dumps(to_dict(cfg), default=lambda x: list(x) if isinstance(x, tuple) else str(x)))


def write_config(cfg, workdir: str) -> None:
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump(as_json(cfg), f, indent=2)


CORPUS_FILE = "corpus.json"  # beside config.json: the gdn-corpus build that a token-file run's checkpoints saw


def _corpus_now(cfg):
  """The manifest of the gdn-corpus build that the run's train file belongs to, or None (other data)."""
  return corpus.describe(cfg.data.text.train_file) if cfg.data.task == "tokens" else None


def write_corpus(cfg, workdir: str) -> None:
  """Records beside config.json which corpus build the run trains on (nothing for other data)."""
  now = _corpus_now(cfg)
  if now is not None:
    with open(os.path.join(workdir, CORPUS_FILE), "w") as f:
      json.dump(now, f, indent=2)


def check_corpus(cfg, workdir: str, has_checkpoints: bool) -> None:
  """Raise ConfigMismatch if the checkpoints in `workdir` were trained on another gdn-corpus build than the one
  the train file belongs to now. gdn-corpus reads the installation it runs in, so one path can hold other bytes
  after a package is installed; config.json names the path only, and a resumed run would go on with other
  windows and another validation file."""
  path = os.path.join(workdir, CORPUS_FILE)
  now = _corpus_now(cfg)
  if not has_checkpoints or now is None or not os.path.exists(path):
    return
  with open(path) as f:
    then = json.load(f)
  old, new = then["train"]["sha256"], now["train"]["sha256"]
  if old != new:
    raise ConfigMismatch(
        f"the checkpoints in {workdir} were trained on the corpus whose train.bin has SHA-256 {old[:12]} "
        f"({then['train'].get('files')} files, Python {then.get('python')}), and {cfg.data.text.train_file} is "
        f"now {new[:12]} ({now['train'].get('files')} files, Python {now.get('python')}; gdn-corpus reads the "
        "installation it runs in). Rebuild the corpus as it was, or use another config.workdir, "
        "--config.train.resume=fresh or --config.train.resume=params_only")


def saved_config(workdir: str):
  """The config dict in `<workdir>/config.json`, or None."""
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def flat(d: dict, prefix: str = "") -> dict:
  """A nested config dict as {dotted key: value}."""
  out = {}
  for k, v in d.items():
    if isinstance(v, dict) and v:
      out.update(flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def differences(saved: dict, new: dict) -> dict:
  """{dotted key: (saved value, new value)} for every key that differs and is not RESUMABLE. A key that the
  saved config lacks counts as its default (a field added to the code since: the old run used its default
  behaviour); a key that the code no longer has is left out."""
  a, b, default = flat(saved), flat(new), flat(as_json(ExperimentConfig()))
  old = lambda k: a.get(k, default.get(k))
  return {k: (old(k), b[k]) for k in sorted(b)
          if old(k) != b[k] and not any(k == r or k.startswith(r + ".") for r in RESUMABLE)}


def decide(workdir: str, new: dict, has_checkpoints: bool) -> str:
  """What this launch does with the work directory, given the new config as `as_json` makes it: "resume"
  (continue, or start if there is nothing to continue), or "fresh" / "params_only" (set the previous run aside
  first). Raises ConfigMismatch for a config that differs from the checkpoints' in keys other than RESUMABLE
  under train.resume="auto".

  The switch acts once: a work directory whose config.json already equals the new config, train.resume
  included, is the run that the switch started, and a relaunch of the same command resumes it.
  """
  saved = saved_config(workdir)
  mode = new["train"]["resume"]
  if saved == new:
    return "resume"
  if not has_checkpoints and mode == "params_only":
    raise ConfigMismatch(f"config.train.resume='params_only' needs a checkpoint to take the parameters from, "
                         f"and {workdir} has none")
  if not has_checkpoints and (saved is None or mode == "auto"):  # nothing to continue, compare or set aside
    return "resume"
  if mode != "auto":
    return mode
  if saved is None:  # checkpoints from before config.json was written: nothing to compare with
    return "resume"
  diff = differences(saved, new)
  if not diff:
    return "resume"
  shown = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in diff.items())
  raise ConfigMismatch(
      f"the config differs from the one that wrote the checkpoints in {workdir} in {len(diff)} key(s): {shown}. "
      "Use the original config, another config.workdir, --config.train.resume=fresh (set the old run aside and "
      "start again) or --config.train.resume=params_only (start again from its parameters)")


def has_checkpoints(directory: str) -> bool:
  return os.path.isdir(directory) and any(d.isdigit() for d in os.listdir(directory))


def finished(cfg, run_dir: str = "") -> bool:
  """Whether the run of `cfg` has ended: its summary.json (in `run_dir`, default cfg.run_dir) is at or past
  train.last_step (a run of the whole schedule is finished for a sweep cut shorter by train.stop_step) or says it
  stopped early."""
  path = os.path.join(run_dir or cfg.run_dir, "summary.json")
  if not os.path.exists(path):
    return False
  with open(path) as f:
    summary = json.load(f)
  return summary.get("steps", -1) >= cfg.train.last_step or bool(summary.get("stopped_early"))


def finished_summary(cfg):
  """The summary of the run in cfg.run_dir if it has ended (`finished`) and its newest checkpoint is the step
  that summary describes (not a run resumed past it and killed), else None."""
  ckdir = os.path.join(cfg.run_dir, "checkpoints")
  if not finished(cfg) or not has_checkpoints(ckdir):
    return None
  with open(os.path.join(cfg.run_dir, "summary.json")) as f:
    summary = json.load(f)
  newest = max(int(d) for d in os.listdir(ckdir) if d.isdigit())
  return summary if summary.get("steps") == newest else None


def next_previous(workdir: str) -> str:
  """Where `set_aside` would put the run now in `workdir`: `<workdir>/previous/<n>`, numbered from 1."""
  root = os.path.join(workdir, "previous")
  taken = [int(d) for d in os.listdir(root) if d.isdigit()] if os.path.isdir(root) else []
  return os.path.join(root, str(max(taken, default=0) + 1))


def set_aside(workdir: str, dest: str) -> None:
  """Moves the previous run's files (RUN_FILES) from `workdir` into `dest`."""
  os.makedirs(dest)
  for name in RUN_FILES:
    if os.path.exists(os.path.join(workdir, name)):
      shutil.move(os.path.join(workdir, name), os.path.join(dest, name))


class LaunchTimes:
  """Wall seconds of each launch of a run that resumes from its checkpoints, in `<run_dir>/launches.json` as
  [{"from_step", "to_step", "seconds", "marks": [[step, seconds], ...]}]. This launch's entry is rewritten at each
  of its checkpoints (`mark`). A launch that resumes from step `start` keeps each earlier launch up to its last
  mark at or before `start` (a checkpoint that was written but not restored, e.g. one still being saved when the
  process was killed, does not count) and drops launches that began at or after it. A summary gives `seconds`
  (this launch) and `seconds_total` (`total`: every launch's up to now), so a run cut and resumed reports what it
  cost in all."""

  def __init__(self, run_dir: str, start: int, t0: float, write: bool = True):
    self.path, self.start, self.t0, self.write = os.path.join(run_dir, "launches.json"), start, t0, write
    self.earlier, self.marks = [], []
    if start > 0:
      try:
        with open(self.path) as f:
          entries = json.load(f)
        for e in entries:
          kept = [[int(m[0]), float(m[1])] for m in e["marks"] if int(m[0]) <= start]
          if int(e["from_step"]) < start and kept:
            self.earlier.append(dict(from_step=int(e["from_step"]), to_step=kept[-1][0], seconds=kept[-1][1],
                                     marks=kept))
      except (OSError, ValueError, TypeError, KeyError, IndexError):  # none yet (a run from before the file)
        self.earlier = []

  def mark(self, step: int, now: float) -> None:
    """After a checkpoint of `step` (and at the run's end): this launch's entry, written atomically."""
    self.marks.append([step, now - self.t0])
    if not self.write:
      return
    entry = dict(from_step=self.start, to_step=step, seconds=now - self.t0, marks=self.marks)
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      json.dump(self.earlier + [entry], f)
    os.replace(tmp, self.path)

  def total(self, now: float) -> float:
    return sum(e["seconds"] for e in self.earlier) + now - self.t0

  @property
  def launches(self) -> int:
    return len(self.earlier) + 1
