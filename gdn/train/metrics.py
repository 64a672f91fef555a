"""Metrics to JSON lines (the record that comparisons read) and TensorBoard."""

from __future__ import annotations

import json
import os

import tensorboardX


class MetricWriter:
  """Appends {"step": s, "<prefix>/<name>": value, ...} lines to metrics.jsonl and scalars to tb/."""

  def __init__(self, workdir: str, resume_step: int = 0):
    self.path = os.path.join(workdir, "metrics.jsonl")
    # A run killed after its last checkpoint logged steps that the resumed run will redo: drop them so the
    # file reads as one uninterrupted run.
    if os.path.exists(self.path):
      keep = [line for line in read_jsonl(self.path) if line["step"] <= resume_step]
      with open(self.path + ".tmp", "w") as f:  # then renamed: a kill mid-write loses no history
        f.writelines(json.dumps(r) + "\n" for r in keep)
      os.replace(self.path + ".tmp", self.path)
    self._file = open(self.path, "a")
    self._tb = tensorboardX.SummaryWriter(os.path.join(workdir, "tb"), purge_step=resume_step + 1)

  def write(self, step: int, prefix: str, metrics: dict) -> None:
    record = {"step": int(step), **{f"{prefix}/{k}": float(v) for k, v in metrics.items()}}
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    for k, v in record.items():
      if k != "step":
        self._tb.add_scalar(k, v, step)

  def close(self) -> None:
    self._file.close()
    self._tb.close()


def read_jsonl(path: str) -> list:
  """The records of a metrics file; a line cut short by a kill is skipped."""
  out = []
  with open(path) as f:
    for line in f:
      try:
        out.append(json.loads(line))
      except json.JSONDecodeError:
        continue
  return out
