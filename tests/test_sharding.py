"""Sharded training (data parallel + FSDP) on 8 CPU devices equals one device, and resumes from a checkpoint.

The device count is fixed when JAX starts, so the checks run in a child process started with
XLA_FLAGS=--xla_force_host_platform_device_count=8 (this file run as a script).
"""

import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from devices import device_count_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_param_spec_rules():
  from gdn.train.sharding import param_spec

  assert tuple(param_spec((64, 32), 4)) == ("fsdp", None)
  assert tuple(param_spec((64, 30), 4)) == ("fsdp", None)
  assert tuple(param_spec((30, 64), 4)) == (None, "fsdp")
  assert tuple(param_spec((30, 6), 4)) == ()  # nothing divisible: replicated
  assert tuple(param_spec((), 4)) == ()
  assert tuple(param_spec((64, 32), 1)) == ()


def test_make_mesh_errors():
  from gdn.train.sharding import make_mesh

  with pytest.raises(ValueError, match="fsdp must be a positive divisor"):
    make_mesh(fsdp=3, devices=[object()] * 8)
  with pytest.raises(ValueError, match="data \\* fsdp must equal"):
    make_mesh(data=3, fsdp=2, devices=[object()] * 8)


@pytest.mark.slow
def test_sharded_training_on_8_devices():
  with tempfile.TemporaryDirectory() as d:
    # Fewer optimisations compile faster (the checks are math, not XLA's fusions); the persistent cache lets the
    # resumed run reuse the programs that the run it resumes compiled, as a resumed run does by default.
    env = dict(os.environ, XLA_FLAGS=device_count_flags(8), JAX_PLATFORMS="cpu",
               JAX_DISABLE_MOST_OPTIMIZATIONS="1", JAX_COMPILATION_CACHE_DIR=os.path.join(d, "jax_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    r = subprocess.run([sys.executable, __file__, d], env=env, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  assert "sharded ok" in r.stdout


def test_cudnn_operands_pinned_alike():
  """cuDNN attention's partitioner needs q, k, v sharded alike, on batch only: under the step's mesh,
  `shard_alike_for_cudnn` pins differently sharded inputs to the batch split (replicated when B does not
  divide), and leaves them alone outside a mesh context."""
  from devices import run_child

  out = run_child(__file__, "cudnn")
  assert out["under_mesh"] == [["data,fsdp", None, None, None]] * 3, out
  assert out["batch_not_divisible"] == [[None, None, None, None]] * 3, out
  assert out["no_mesh"][1] == [None, None, "fsdp", None], out  # k keeps its own sharding


def _cudnn_child():
  import json

  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P

  from gdn.layers.attention import shard_alike_for_cudnn
  from gdn.train.sharding import make_mesh

  mesh = make_mesh(data=4, fsdp=2)

  def specs(arrays):
    out = []
    for a in arrays:
      spec = tuple(a.sharding.spec) + (None,) * (a.ndim - len(a.sharding.spec))
      out.append([",".join(x) if isinstance(x, tuple) else x for x in spec])
    return out

  def run(B, context):
    q = jax.device_put(jnp.ones((B, 16, 4, 8)), NamedSharding(mesh, P(None, "data")))  # split along T
    k = jax.device_put(jnp.ones((B, 16, 2, 8)), NamedSharding(mesh, P(None, None, "fsdp")))  # along heads
    v = jax.device_put(jnp.ones((B, 16, 2, 8)), NamedSharding(mesh, P()))

    @jax.jit
    def f(q, k, v):
      if not context:
        return shard_alike_for_cudnn(q * 2, k * 2, v * 2)
      with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        return shard_alike_for_cudnn(q * 2, k * 2, v * 2)

    return specs(f(q, k, v))

  print(json.dumps(dict(under_mesh=run(8, True), batch_not_divisible=run(6, True), no_mesh=run(8, False))))


def _child(workdir):
  import jax
  import jax.numpy as jnp

  from gdn.config import AttentionConfig, ModelConfig, recurrent_preset
  from gdn.train import sharding
  from gdn.train.checkpoint import Checkpoints
  from gdn.train.config import TrainConfig
  from gdn.train.optimizer import lr_shape, make_optimizer
  from gdn.train.step import init, make_train_step

  assert jax.device_count() == 8
  model_cfg = ModelConfig(vocab_size=64, d_model=32, num_layers=2, pattern="RA",
                          recurrent=recurrent_preset("gated_deltanet", num_heads=2, head_dim=16, chunk_size=16),
                          attention=AttentionConfig(num_heads=2, head_dim=16))
  train_cfg = TrainConfig(steps=20, warmup_steps=2, learning_rate=3e-3)
  tx = make_optimizer(train_cfg)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 64, size=(5, 8, 33)).astype(np.int32)
  batches = [dict(inputs=t[:, :-1], targets=t[:, 1:], weights=np.ones((8, 32), np.float32)) for t in tokens]

  graphdef, _ = init(model_cfg, tx, seed=0)
  step = make_train_step(graphdef, tx, lr_shape(train_cfg))  # one jitted step for every run below

  def run(mesh, steps, state=None):
    state = init(model_cfg, tx, seed=0)[1] if state is None else state
    if mesh is not None:
      state = jax.device_put(state, sharding.tree_shardings(state, mesh))
    losses = []
    for b in steps:
      batch = sharding.shard_batch(b, mesh) if mesh is not None else jax.tree.map(jnp.asarray, b)
      state, m = step(state, batch)
      losses.append((float(m["loss"]), float(m["grad_norm"])))
    return state, np.array(losses)

  one, losses1 = run(None, batches)
  mesh = sharding.make_mesh(data=2, fsdp=4)
  many, losses8 = run(mesh, batches)
  np.testing.assert_allclose(losses8, losses1, rtol=1e-5)
  flat1, flat8 = jax.tree.leaves(one.params), jax.tree.leaves(many.params)
  for a, b in zip(flat1, flat8):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)
  split = [x for x in flat8 if "fsdp" in str(x.sharding.spec)]
  assert split, "no parameter was split over the fsdp axis"
  assert all(len(x.addressable_shards) == 8 for x in flat8)

  # 3 sharded steps, checkpoint, resume on the mesh, 2 more: the same as 5 steps straight.
  part, _ = run(mesh, batches[:3])
  ckpt = Checkpoints(os.path.join(workdir, "ckpt"), keep=2)
  ckpt.save(3, part, {"batch": 3})
  ckpt.close()
  _, template = init(model_cfg, tx, seed=0)
  restored, data_state, at = Checkpoints(os.path.join(workdir, "ckpt"), keep=2).restore_latest(template)
  assert at == 3 and data_state == {"batch": 3}
  _, resumed = run(mesh, batches[3:], state=restored)
  np.testing.assert_allclose(resumed, losses1[3:], rtol=1e-5)

  # The training loop on meshes from its config: FSDP (2 x 4) stopped at step 3 and resumed to step 4 logs the
  # losses of a plain data-parallel (8 x 1) run straight through (quickstart shrunk to the model above: the mesh
  # plumbing, not the model's size, is under test).
  import json
  from gdn.train.config_file import resolve
  from gdn.train.loop import train

  def losses_of(name, *overrides):
    cfg = resolve(os.path.join(ROOT, "configs", "quickstart.py"), [
        f"workdir={os.path.join(workdir, name)}", "train.steps=6", "train.warmup_steps=1", "train.log_every=1",
        "train.eval_every=0", "train.checkpoint_every=1", "train.progress_bar=false", "data.batch_size=8",
        "data.mqar.eval_examples=8", "model.recurrent.method=recurrent", "model.num_layers=2", "model.pattern=RA",
        "model.d_model=32", "model.recurrent.head_dim=16", "model.attention.head_dim=16", "model.vocab_size=64",
        "data.mqar.vocab_size=64", "data.mqar.train_settings=((32,4),)", "data.mqar.eval_settings=((32,4),)",
        *overrides])
    train(cfg, log=lambda *a: None)
    with open(os.path.join(workdir, name, "metrics.jsonl")) as f:
      rows = [json.loads(line) for line in f]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}

  straight = losses_of("dp", "train.mesh_data=8", "train.mesh_fsdp=1", "train.stop_step=4")
  losses_of("fsdp", "train.mesh_data=2", "train.mesh_fsdp=4", "train.stop_step=3")
  resumed = losses_of("fsdp", "train.mesh_data=2", "train.mesh_fsdp=4", "train.stop_step=4")
  assert sorted(straight) == [1, 2, 3, 4] and sorted(resumed) == [1, 2, 3, 4], (straight, resumed)
  np.testing.assert_allclose([resumed[s] for s in range(1, 5)], [straight[s] for s in range(1, 5)], rtol=1e-5)
  print("sharded ok")


if __name__ == "__main__":
  _cudnn_child() if sys.argv[1] == "cudnn" else _child(sys.argv[1])
