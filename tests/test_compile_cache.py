"""config.compilation_cache: gdn-train points XLA's persistent cache beside the work directory, a second run of
the same model with another seed and learning rate compiles nothing new, and "" turns the cache off."""

import os
import subprocess
import sys

import pytest

from gdn.train.compile_cache import cache_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["model.d_model=32", "model.num_layers=1", "model.pattern=A", "model.vocab_size=64",
        "model.attention.num_heads=2", "model.attention.head_dim=16", "data.batch_size=4",
        "data.mqar.vocab_size=64", "data.mqar.train_settings=((32,4),)", "data.mqar.eval_settings=((32,4),)",
        "data.mqar.eval_examples=8", "train.steps=4", "train.warmup_steps=1", "train.eval_every=0",
        "train.checkpoint_every=0", "train.progress_bar=false"]


def test_cache_dir_names():
  assert cache_dir("auto", "results/mqar/runs/cell") == os.path.abspath("results/mqar/runs/.jax_cache")
  assert cache_dir("", "runs/x") is None
  assert cache_dir("/tmp/xla", "runs/x") == "/tmp/xla"


@pytest.mark.slow
def test_second_seed_compiles_nothing(tmp_path):
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  # Fewer optimisations compile faster: the cache's entries, not XLA's fusions, are under test.
  env.update(JAX_PLATFORMS="cpu", JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_DISABLE_MOST_OPTIMIZATIONS="1")
  cache = tmp_path / "runs" / ".jax_cache"

  def run(name, *extra):
    args = [sys.executable, "-m", "experiments.train", "--config", os.path.join(ROOT, "configs", "quickstart.py"),
            *(f"--config.{o}" for o in TINY), f"--config.workdir={tmp_path / 'runs' / name}", *extra]
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return set(os.listdir(cache))

  first = run("seed0")
  assert first, "the first run wrote no cache entries"
  # The seed and the learning rate are not constants of any program: every program came from the cache.
  assert run("seed1", "--config.seed=1", "--config.train.learning_rate=0.01") == first
  # "" = off: a wider model's programs are compiled but not added.
  assert run("nocache", "--config.model.d_model=48", "--config.compilation_cache=") == first
