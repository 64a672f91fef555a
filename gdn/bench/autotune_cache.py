"""Triton's autotuning choices kept between benchmark calls (fla's kernels on the GPU machine).

fla picks each kernel's launch config per shape by compiling and timing every candidate (Triton's autotuner). On
the H200 a shape of `experiments/bench_vs_fla.py` took 110-170 s with fla against about 20 s for gdn alone
(`--gdn-only`, three switch settings), so a five-shape call against fla barely fits, or does not fit, in ten
minutes. Triton can keep each choice in its cache directory
(`<TRITON_CACHE_DIR>/<key>/<kernel>.autotune.json`, the key a hash of Triton's version, the target, the kernel's
source, the tuning key and the candidates; fla asks for it, FLA_CACHE_RESULTS, and TRITON_CACHE_AUTOTUNING asks
for it for every autotuned kernel). A later process with those files takes the recorded choice and compiles that
config alone. The choice is fla's own autotuner's, on the same kind of card: what fla gives from its second run
on.

`use(store)` points Triton at a fresh cache directory holding the `.autotune.json` files of `store` (a directory,
committed or carried) and returns a function that copies the new ones back; it is also called at exit, and a
SIGTERM (`timeout`) exits through it, so the choices of a call cut short are kept too. Compiled kernels are not
kept: they stay in the temporary directory.
"""

from __future__ import annotations

import atexit
import os
import pathlib
import shutil
import signal
import sys
import tempfile

SUFFIX = ".autotune.json"


def copy_choices(src, dst) -> int:
  """Copies every `<key>/<kernel>.autotune.json` under `src` that `dst` lacks; returns how many."""
  src, dst = pathlib.Path(src), pathlib.Path(dst)
  n = 0
  for f in sorted(src.glob(f"*/*{SUFFIX}")):
    target = dst / f.parent.name / f.name
    if not target.exists():
      target.parent.mkdir(parents=True, exist_ok=True)
      shutil.copyfile(f, target)
      n += 1
  return n


def use(store):
  """Before fla is imported: a fresh TRITON_CACHE_DIR with the choices in `store` (made if missing), autotune
  caching on. Returns `save() -> int`, which copies the choices made since into `store` (the count), run at exit
  too. None for no store: nothing set, and `save` copies nothing."""
  if store is None:
    return lambda: 0
  if "fla" in sys.modules:
    raise RuntimeError("--autotune-cache: fla is imported already; its kernels would not cache their choices")
  store = pathlib.Path(store)
  store.mkdir(parents=True, exist_ok=True)
  cache = tempfile.mkdtemp(prefix="triton_cache_")
  copy_choices(store, cache)
  os.environ["TRITON_CACHE_DIR"] = cache
  os.environ["TRITON_CACHE_AUTOTUNING"] = "1"
  os.environ["FLA_CACHE_RESULTS"] = "1"

  def save() -> int:
    return copy_choices(cache, store)

  atexit.register(save)
  if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
  return save
