"""Training with context parallelism (`train.mesh_seq`) on 8 CPU devices equals one device, and resumes.

A tiny "RA" hybrid (chunk form, T = 64, chunk 16) takes three AdamW steps on one device, on a (data 2, fsdp 2,
seq 2) mesh and on a (1, 1, 8) mesh (slices of 8 steps, shorter than a chunk); the losses and gradient norms
agree. The training loop on the seq mesh, stopped after step 2 and resumed, logs the same losses. The
multi-device checks run in a child process (tests/devices.py), which prints them as JSON.
"""

import json
import os
import sys

import numpy as np
import pytest

from devices import run_child

# The checks are math, not XLA's fusions: fewer optimisations compile faster (conftest.py).
pytestmark = pytest.mark.usefixtures("fast_compile")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-5
STEPS = 3
# Batch 4: one row per device of the (2, 2, 2) mesh's data x fsdp; T = 64 from the single MQAR setting.
OVERRIDES = [
    "model.d_model=32", "model.num_layers=2", "model.pattern=RA", "model.vocab_size=64",
    "model.recurrent.num_heads=2", "model.recurrent.head_dim=16", "model.attention.num_heads=2",
    "model.attention.head_dim=16", "model.recurrent.method=chunk", "model.recurrent.chunk_size=16",
    "data.batch_size=4", "data.mqar.vocab_size=64", "data.mqar.train_settings=((64,8),)",
    "data.mqar.eval_settings=((64,8),)", "data.mqar.eval_examples=4", f"train.steps={STEPS}",
    "train.warmup_steps=1", "train.learning_rate=3e-3", "train.log_every=1", "train.eval_every=0",
    "train.checkpoint_every=0", "train.progress_bar=false",
]


def _config(*extra):
  from gdn.train.config_file import resolve

  return resolve(os.path.join(ROOT, "configs", "quickstart.py"), OVERRIDES + list(extra))


def test_dropout_and_per_channel_beta_are_refused_with_mesh_seq():
  from gdn.train import ConfigError

  with pytest.raises(ConfigError, match=r"config\.train\.mesh_seq=2 .*config\.model\.recurrent\.dropout"):
    _config("train.mesh_seq=2", "model.recurrent.dropout=0.1")
  with pytest.raises(ConfigError, match=r"config\.train\.mesh_seq=2 .*config\.model\.recurrent\.beta"):
    _config("train.mesh_seq=2", "model.recurrent.beta=channel")
  with pytest.raises(ConfigError, match=r"config\.train\.mesh_seq"):
    _config("train.mesh_seq=0")
  assert _config("model.recurrent.dropout=0.1").train.mesh_seq == 1  # one device on the time axis: allowed


def test_mesh_that_does_not_fit_the_devices_names_mesh_seq(tmp_path):
  import jax

  from gdn.train import ConfigError, train

  n = jax.device_count()
  with pytest.raises(ConfigError, match=r"config\.train\.mesh_seq=.*device count"):
    train(_config(f"workdir={tmp_path}", f"train.mesh_seq={n + 1}"), log=lambda *a: None)


def test_check_mesh_axes_takes_a_tuple_of_batch_axes():
  import jax
  from jax.sharding import Mesh

  from gdn.ops.context_parallel import check_mesh_axes

  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "seq"))
  assert check_mesh_axes(mesh, "seq", ("data", "fsdp"), 3) == 1
  with pytest.raises(ValueError, match="must differ"):
    check_mesh_axes(mesh, "seq", ("data", "seq"), 2)
  with pytest.raises(ValueError, match="'rows' is not an axis"):
    check_mesh_axes(mesh, "seq", ("data", "rows"), 2)
  with pytest.raises(ValueError, match="twice"):
    check_mesh_axes(mesh, "seq", ("data", "data"), 2)


def test_seq_mesh_and_batch_sharding():
  import jax
  from jax.sharding import Mesh

  from gdn.train.sharding import batch_devices, batch_sharding, make_mesh

  with pytest.raises(ValueError, match="seq must be a positive divisor"):
    make_mesh(fsdp=2, seq=3, devices=[object()] * 8)
  with pytest.raises(ValueError, match=r"data \* fsdp \* seq must equal"):
    make_mesh(data=2, fsdp=2, seq=4, devices=[object()] * 8)
  assert make_mesh(devices=jax.devices()[:1]).axis_names == ("data", "fsdp")  # seq 1: the mesh of old
  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "seq"))
  assert batch_devices(mesh) == 1
  assert tuple(batch_sharding(mesh, (4, 64)).spec) == (("data", "fsdp"),)  # seq of size 1 splits nothing


@pytest.mark.slow
def test_context_parallel_training_matches_one_device_and_resumes(tmp_path):
  r = run_child(__file__, str(tmp_path))
  rel = lambda got, want: float(np.max(np.abs(np.subtract(got, want)) / np.abs(want)))
  one = np.array(r["one"])
  assert one.shape == (STEPS, 2) and np.all(np.isfinite(one))
  for mesh in ("2x2x2", "1x1x8"):
    assert rel(r[mesh], one) <= TOL, (mesh, r[mesh], one.tolist())
  # T split over "seq" where it divides; rows only for `process_rows`.
  assert r["batch_spec"] == [[["data", "fsdp"], "seq"], [["data", "fsdp"]]], r["batch_spec"]
  assert r["fsdp_kept"], "parameters lost their fsdp sharding (or took a seq one) in the context-parallel step"
  assert "config.train.mesh_seq=8" in r["short_error"] and "slices of 2" in r["short_error"], r["short_error"]
  loop = r["loop"]
  assert sorted(map(int, loop)) == list(range(1, STEPS + 1)), loop
  assert rel([loop[str(s)] for s in range(1, STEPS + 1)], one[:, 0]) <= TOL, (loop, one[:, 0].tolist())


def _child(workdir):
  """Runs in the child process on 8 CPU devices: the losses of every run, as JSON on the last line."""
  import jax

  from gdn.data import make_task
  from gdn.train import ConfigError, train
  from gdn.train import optimizer, sharding
  from gdn.train.metrics import read_jsonl
  from gdn.train.step import init, make_train_step

  assert jax.device_count() == 8
  # The loop's steps compile to the programs compiled before them here: a persistent cache compiles them once.
  jax.config.update("jax_compilation_cache_dir", os.path.join(workdir, "jax_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  cfg = _config()
  task = make_task(cfg.data, cfg.seed, STEPS)
  batches = [task.train[i] for i in range(STEPS)]
  tx, lr = optimizer.make_optimizer(cfg.train), optimizer.lr_shape(cfg.train)
  graphdef, _ = init(cfg.model, tx, cfg.seed)

  def run(mesh):
    step = make_train_step(graphdef, tx, lr, mesh=mesh)
    state = init(cfg.model, tx, cfg.seed)[1]
    # Committed inputs: the host runtime has deadlocked in a collective fed with uncommitted host arrays.
    if mesh is None:
      place = lambda x: jax.device_put(x, jax.devices()[0])
      state = place(state)
    else:
      place = lambda b: sharding.shard_batch(b, mesh, cfg.data.batch_size)
      state = sharding.shard_state(state, mesh)
    out = []
    for b in batches:
      state, m = step(state, place(b))
      out.append([float(m["loss"]), float(m["grad_norm"])])
    return state, out

  result = {"one": run(None)[1]}
  mesh = sharding.make_mesh(2, 2, seq=2)
  before = sharding.tree_shardings(init(cfg.model, tx, cfg.seed)[1].params, mesh)
  state, result["2x2x2"] = run(mesh)
  result["batch_spec"] = [tuple(sharding.shard_batch(batches[0], mesh)["inputs"].sharding.spec),
                          tuple(sharding.batch_sharding(mesh).spec)]
  result["fsdp_kept"] = (any("fsdp" in tuple(want.spec) for want in jax.tree.leaves(before))
                         and all(want.is_equivalent_to(x.sharding, x.ndim) for want, x in
                                 zip(jax.tree.leaves(before), jax.tree.leaves(state.params))))
  seq8 = sharding.make_mesh(1, 1, seq=8)
  result["1x1x8"] = run(seq8)[1]

  # T = 16 on 8 devices leaves slices of 2 steps, fewer than the conv's 3: refused when the step is traced.
  short = {k: v[:, :16] for k, v in batches[0].items()}
  try:
    step = make_train_step(graphdef, tx, lr, mesh=seq8)
    step(sharding.shard_state(init(cfg.model, tx, cfg.seed)[1], seq8), sharding.shard_batch(short, seq8))
    result["short_error"] = ""
  except ConfigError as e:
    result["short_error"] = str(e)

  # The loop on the seq mesh: stopped after step 2, resumed to step 3.
  run_dir = os.path.join(workdir, "cp")
  for stop in (2, 3):
    train(_config(f"workdir={run_dir}", "train.mesh_data=1", "train.mesh_fsdp=1", "train.mesh_seq=8",
                  f"train.stop_step={stop}"), log=lambda *a: None)
  result["loop"] = {str(r["step"]): r["train/loss"] for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
                    if "train/loss" in r}
  print(json.dumps(result))


if __name__ == "__main__":
  _child(sys.argv[1])
