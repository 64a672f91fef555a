"""Training over two processes (two forced CPU devices each, gloo collectives) logs the losses of one process.

Each process loads only its half of every batch and the global batch is assembled with
`jax.make_array_from_process_local_data`; the parameters are split over all four devices (FSDP across the
processes). Both processes then restore the checkpoint they wrote together and place it on the mesh, and the
checkpoint holds the parameters of the one-process run. The workers are this file run as a script.
"""

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from devices import device_count_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "quickstart.py")
# Orbax's async checkpointer may leave its event loop to close after a test ends.
pytestmark = [pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
              pytest.mark.usefixtures("fast_compile")]  # fewer optimisations compile faster (conftest.py)
PROCESSES, DEVICES_EACH, BATCH = 2, 2, 8
# One attention layer: compiling the train and eval steps is most of the test's time, and attention compiles in
# two thirds of the recurrent layer's; the layers' sharding is tests/test_sharding.py's subject, the data path
# and the checkpoints this file's.
TINY = [
    "model.d_model=32", "model.num_layers=1", "model.pattern=A", "model.vocab_size=64",
    "model.attention.num_heads=2", "model.attention.head_dim=16", f"data.batch_size={BATCH}",
    "data.mqar.vocab_size=64", "data.mqar.train_settings=((32,4),)", "data.mqar.eval_settings=((32,4),)",
    "data.mqar.eval_examples=8", "train.steps=100", "train.warmup_steps=1", "train.learning_rate=3e-3",
    "train.log_every=1", "train.eval_every=0", "train.checkpoint_every=2", "train.progress_bar=false",
    "train.stop_step=3",
]


def _config(workdir, *overrides):
  from gdn.train.config_file import resolve

  return resolve(CONFIG, [*TINY, f"workdir={workdir}", *overrides])


def _logged(workdir):
  from gdn.train.metrics import read_jsonl

  rows = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  return ({r["step"]: r["train/loss"] for r in rows if "train/loss" in r},
          {r["step"]: r["eval/loss"] for r in rows if "eval/loss" in r})


def _free_port():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def test_process_rows_are_the_slices_of_the_global_batch(tmp_path):
  """What each process loads (text reads only its rows' windows, the synthetic tasks cut a drawn batch) equals
  the same rows of the batch that one process loads."""
  from gdn.data import DataConfig, make_task
  from gdn.data.text import TextConfig

  rng = np.random.default_rng(0)
  for i in range(8):  # half of these names hash into the validation split
    (tmp_path / f"f{i}.py").write_bytes(rng.integers(32, 127, size=4000).astype(np.uint8).tobytes())
  text = TextConfig(seq_len=64, corpus_dir=str(tmp_path), val_fraction=0.5)
  for cfg in (DataConfig(task="mqar", batch_size=8), DataConfig(task="state", batch_size=8),
              DataConfig(task="bytes", batch_size=8, text=text)):
    whole = make_task(cfg, seed=3, num_batches=5).train
    for rows in (slice(0, 4), slice(4, 8), slice(2, 6)):
      part = make_task(cfg, seed=3, num_batches=5, rows=rows).train
      assert len(part) == len(whole)
      for i in (0, 4):
        for name, x in whole[i].items():
          np.testing.assert_array_equal(part[i][name], x[rows], err_msg=f"{cfg.task} batch {i} {name} {rows}")
  with pytest.raises(ValueError, match="not inside a batch"):
    make_task(DataConfig(batch_size=8), 0, 1, rows=slice(4, 12))


def test_one_process_holds_every_row():
  import jax
  from gdn.train import sharding

  mesh = sharding.make_mesh(devices=jax.devices()[:1])
  assert sharding.process_rows(mesh, 4) == slice(0, 4)
  batch = dict(inputs=np.arange(12, dtype=np.int32).reshape(4, 3))
  np.testing.assert_array_equal(sharding.shard_batch(batch, mesh, 4)["inputs"], batch["inputs"])
  with pytest.raises(ValueError, match="whole batch"):
    sharding.shard_batch(dict(inputs=batch["inputs"][:2]), mesh, 4)


@pytest.mark.slow
def test_two_processes_train_like_one_and_restore(tmp_path):
  port = _free_port()
  shared = str(tmp_path / "two")
  env = dict(os.environ, XLA_FLAGS=device_count_flags(DEVICES_EACH), JAX_PLATFORMS="cpu",
             JAX_DISABLE_MOST_OPTIMIZATIONS="1",  # as the fast_compile fixture does for the one-process run
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  workers = [subprocess.Popen([sys.executable, __file__, str(p), str(port), shared], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for p in range(PROCESSES)]
  try:
    # The reference runs here, on this process's one device, while the workers start and compile.
    from gdn.train.loop import train

    one = str(tmp_path / "one")
    train(_config(one), log=lambda *a: None)
    deadline = time.time() + 240
    outputs = [w.communicate(timeout=max(deadline - time.time(), 1))[0] for w in workers]
  finally:
    for w in workers:  # a worker left waiting in a collective for its dead peer would never exit
      if w.poll() is None:
        w.kill()
        w.communicate()
  for p, (w, out) in enumerate(zip(workers, outputs)):
    assert w.returncode == 0, f"process {p}:\n{out[-4000:]}"
    assert f"process {p} ok" in out, out[-4000:]

  train1, eval1 = _logged(one)
  train2, eval2 = _logged(shared)
  assert sorted(train2) == [1, 2, 3] and sorted(eval2) == [3], (train2, eval2)
  np.testing.assert_allclose([train2[s] for s in (1, 2, 3)], [train1[s] for s in (1, 2, 3)], rtol=1e-5)
  np.testing.assert_allclose(eval2[3], eval1[3], rtol=1e-5)
  with open(os.path.join(shared, "summary.json")) as f:
    assert json.load(f)["steps"] == 3

  # The checkpoint that two processes wrote (process 0 gathering the shards that lived on process 1's devices)
  # holds the one-process run's parameters.
  import jax
  from gdn.train import checkpoint, optimizer, step

  cfg = _config(one)
  template = step.init(cfg.model, optimizer.make_optimizer(cfg.train), cfg.seed)[1]
  ref, _, _ = checkpoint.Checkpoints(os.path.join(one, "checkpoints"), 3).restore_latest(template)
  got, data_state, at = checkpoint.Checkpoints(os.path.join(shared, "checkpoints"), 3).restore_latest(template)
  assert at == 3 and data_state == {"next_index": 3}
  for a, b in zip(jax.tree.leaves(ref.params), jax.tree.leaves(got.params)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)


def _worker(process_id, port, workdir):
  import jax

  # gloo is the default CPU collectives implementation in recent jax; set explicitly, it fails loudly if the
  # option goes away instead of leaving cross-process collectives unimplemented.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=PROCESSES,
                             process_id=process_id, initialization_timeout=60)
  from gdn.data import make_task
  from gdn.train import checkpoint, optimizer, sharding, step
  from gdn.train.loop import train

  assert jax.process_count() == PROCESSES and jax.device_count() == PROCESSES * DEVICES_EACH
  mesh = sharding.make_mesh(data=1, fsdp=PROCESSES * DEVICES_EACH)
  share = BATCH // PROCESSES
  rows = sharding.process_rows(mesh, BATCH)
  assert rows == slice(process_id * share, (process_id + 1) * share), rows
  # Parameters split over all four devices, across the two processes.
  cfg = _config(workdir, "train.mesh_data=1", f"train.mesh_fsdp={PROCESSES * DEVICES_EACH}")
  assert make_task(cfg.data, cfg.seed, 3, rows).train[0]["inputs"].shape[0] == share
  train(cfg)

  # What a resumed run does first: every process restores the same state and data position and places the state.
  template = step.init(cfg.model, optimizer.make_optimizer(cfg.train), cfg.seed)[1]
  ckpts = checkpoint.Checkpoints(os.path.join(workdir, "checkpoints"), 3)
  state, data_state, at = ckpts.restore_latest(template)
  ckpts.close()
  assert at == 3 and data_state == {"next_index": 3}, (at, data_state)
  state = sharding.shard_state(state, mesh)
  assert any("fsdp" in str(x.sharding.spec) for x in jax.tree.leaves(state.params))
  jax.distributed.shutdown()
  print(f"process {process_id} ok", flush=True)


if __name__ == "__main__":
  _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
