"""Batches as grain datasets: a task is a random-access dataset of training batches plus fixed eval splits.

Batch `i` of a run is a pure function of (seed, i), so the data position saved in a checkpoint is grain's
iterator state (the next index) and a resumed run sees exactly the batches it would have seen.
A batch is a dict of numpy arrays: inputs int32 [B, T], targets int32 [B, T], weights float32 [B, T]
(the loss and the accuracies count only positions with weight > 0).

In a run over several processes each one loads only `rows` of every batch (its devices' share, see
`gdn.train.sharding.process_rows`). The iterator state is still just the next batch index, the same in every
process as they step together, so one copy of it in a checkpoint serves them all.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Callable, Optional

import grain
import numpy as np

# Eval data must never overlap the training stream: its generators are seeded from a disjoint stream.
_EVAL_STREAM = 1_000_003


@dataclasses.dataclass(frozen=True)
class Split:
  """A fixed eval set of `num_examples`; `make(rng, start, n)` returns examples start..start+n-1."""
  name: str
  num_examples: int
  make: Callable[[np.random.Generator, int, int], dict]


@dataclasses.dataclass(frozen=True)
class Task:
  name: str
  vocab_size: int
  train: grain.MapDataset  # element i is training batch i (its `rows` where make_task was given rows)
  evals: tuple  # of Split
  chance: float = 0.0  # accuracy of guessing, for the scaled accuracy (acc - chance) / (1 - chance)
  bits_per_token: bool = False  # report loss in bits (byte-level text: bits per byte)
  train_windows: int = 0  # text: the train split's distinct windows (0: drawn fresh, never repeated)
  # The most positions with a positive weight in any row of any batch, train or eval (MQAR: its largest number
  # of pairs, one query each); 0: no bound below the length. train.supervised_head reads it.
  max_supervised: int = 0


def check_settings(name: str, settings, width: int) -> tuple:
  if not settings or any(len(s) != width or any(not isinstance(x, int) or x < 1 for x in s)
                         for s in settings):
    raise ValueError(f"{name} must be a non-empty tuple of {width}-tuples of positive ints, got {settings!r}")
  return settings


def synthetic_train(make_batch: Callable[[np.random.Generator, int], dict], batch_size: int, seed: int,
                    num_batches: int, rows: Optional[slice] = None) -> grain.MapDataset:
  """`num_batches` batches, batch i drawn by `make_batch` from a generator seeded by (seed, i).

  rows: keep only these rows of every batch (None: all). The whole batch is still drawn and then cut: its
  rows come from one generator stream in turn (and a task may pick one length per batch, or redraw rows
  that repeat a key), so a row cannot be drawn without the rows before it; drawing them costs little next to
  a train step, and every process gets exactly its rows of the batch a single process would see.
  """
  ds = grain.MapDataset.range(num_batches).random_map(lambda i, rng: make_batch(rng, batch_size), seed=seed)
  return ds if rows is None else ds.map(lambda batch: {name: x[rows] for name, x in batch.items()})


def eval_batches(split: Split, batch_size: int, seed: int) -> list:
  """The split's examples in batches of `batch_size`; the same for every call with the same seed.

  A last, partial batch is padded to `batch_size` with all-zero rows, whose zero weights leave every eval
  statistic unchanged: one batch shape per split, so the eval step compiles once per split, not twice.
  """
  out = []
  for start in range(0, split.num_examples, batch_size):
    n = min(batch_size, split.num_examples - start)
    rng = np.random.default_rng([_EVAL_STREAM, seed, zlib.crc32(split.name.encode()), start])
    batch = split.make(rng, start, n)
    if n < batch_size:
      batch = {name: np.concatenate([x, np.zeros((batch_size - n,) + x.shape[1:], x.dtype)])
               for name, x in batch.items()}
    out.append(batch)
  return out


def iterator(ds: grain.MapDataset, state: Optional[dict] = None, num_threads: int = 1,
             prefetch: int = 4) -> grain.DatasetIterator:
  """A prefetching iterator over `ds`; `state` (from `get_state()`) resumes where a previous one stopped."""
  it = iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch)))
  if state is not None:
    it.set_state(state)
  return it
