"""DataConfig and the one place that turns it into a `Task`."""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

from gdn.data import mqar, niah, state_tracking, text
from gdn.data.pipeline import Task, synthetic_train

TASKS = ("mqar", "niah", "state", "bytes", "tokens")


@dataclasses.dataclass(frozen=True)
class DataConfig:
  task: str = "mqar"
  batch_size: int = 64
  eval_batch_size: int = 0  # 0 = batch_size; long-context evals want fewer
  num_threads: int = 1  # grain threads filling the prefetch buffer
  mqar: mqar.MQARConfig = mqar.MQARConfig()
  niah: niah.NIAHConfig = niah.NIAHConfig()
  state: state_tracking.StateConfig = state_tracking.StateConfig()
  text: text.TextConfig = text.TextConfig()  # for "bytes" and "tokens"

  def __post_init__(self):
    if self.task not in TASKS:
      raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
    if self.batch_size < 1 or self.eval_batch_size < 0 or self.num_threads < 1:
      raise ValueError("batch_size and num_threads must be positive, eval_batch_size >= 0")

  @property
  def eval_batch(self) -> int:
    return self.eval_batch_size or self.batch_size


def make_task(cfg: DataConfig, seed: int, num_batches: int, rows: Optional[slice] = None) -> Task:
  """The task's first `num_batches` training batches (a grain dataset) and its eval splits.

  rows: the rows of every training batch that this process loads (None: all); a multi-process run passes
  `gdn.train.sharding.process_rows`. Text reads only these rows' windows; the synthetic tasks draw the whole
  batch and cut it (see `synthetic_train`).
  """
  B = cfg.batch_size
  if rows is not None and not 0 <= rows.start < rows.stop <= B:
    raise ValueError(f"rows [{rows.start}, {rows.stop}) are not inside a batch of {B}")
  if cfg.task == "mqar":
    c = cfg.mqar
    train = synthetic_train(functools.partial(mqar.train_batch, c), B, seed, num_batches, rows)
    return Task("mqar", c.vocab_size, train, tuple(mqar.eval_splits(c)), chance=2.0 / c.vocab_size,
                max_supervised=max(P for _, P in c.train_settings + c.eval_settings))
  if cfg.task == "niah":
    c = cfg.niah
    make = lambda rng, n: niah.train_batch(c, rng, n, seed)
    return Task("niah", c.vocab_size, synthetic_train(make, B, seed, num_batches, rows),
                tuple(niah.eval_splits(c, seed)), chance=1.0 / c.vocab_size)
  if cfg.task == "state":
    c = cfg.state
    train = synthetic_train(functools.partial(state_tracking.train_batch, c), B, seed, num_batches, rows)
    return Task(c.task, state_tracking.vocab_size(c), train, tuple(state_tracking.eval_splits(c)),
                chance=state_tracking.chance(c))
  c = cfg.text
  vocab = 256 if cfg.task == "bytes" else c.vocab_size
  # A uint8 token file holds one byte per token (gdn.data.corpus writes them), so its bits per token are bits per
  # byte; wider tokens (a BPE vocabulary) cover several bytes each, and bits per token would not be.
  per_byte = cfg.task == "bytes" or c.token_dtype == "uint8"
  return Task(cfg.task, vocab, text.train_dataset(c, cfg.task, B, seed, num_batches, rows),
              tuple(text.eval_splits(c, cfg.task)), bits_per_token=per_byte,
              train_windows=len(text.Windows(text.streams(c, cfg.task)[0], c.seq_len,
                                               text.split_name(c, cfg.task, "train"))))
