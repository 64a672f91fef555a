"""Whole models with the sequence split over 8 host CPU devices (and 4 x data 2) against one device.

Shapes: B batch, T time, D devices on the sequence axis, Vocab vocabulary size.

The device count of the CPU backend is fixed when jax first initialises it, which the rest of the suite does
before this file runs; the multi-device checks therefore run in a child process started with
`XLA_FLAGS=--xla_force_host_platform_device_count=8` (this file, run as a script), which prints its errors as
JSON for the test here to judge.
"""

import json

import numpy as np
import pytest

from devices import run_child

# The checks are math, not XLA's fusions: fewer optimisations compile faster (conftest.py).
pytestmark = pytest.mark.usefixtures("fast_compile")

VOCAB, C = 64, 16
TOL = 1e-5
# (name, mixer preset, pattern, D, data-parallel size, T, segment ids): T = 128 gives slices of 16 steps on 8
# devices, one chunk each; T = 61 is padded to 64 (slices of 8, shorter than a chunk); the window of 24 spans
# two slices of 32 on 4 devices. The GQA attention layers rotate half of each head (partial RoPE at global
# positions). Compiling the backward dominates the run time, so each model has two layers. The last
# case runs on an Explicit mesh with the batch split over "data" as well.
CASES = [
    ("gated_deltanet RA, packed, T=61", "gated_deltanet", "RA", 8, 1, 61, True),
    ("kda RA, gated attention", "kda", "RA", 8, 1, 128, False),
    ("gated_deltanet RW, Explicit mesh 4 seq x 2 data", "gated_deltanet", "RW", 4, 2, 128, False),
]


def make_model(preset, pattern):
  from flax import nnx

  from gdn.config import AttentionConfig, ModelConfig, recurrent_preset
  from gdn.model import LanguageModel

  rec = recurrent_preset(preset, num_heads=2, head_dim=16, chunk_size=C, decay_low_rank=8)
  att = AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=8, rope_fraction=0.5, window=24,
                        output_gate="sigmoid" if preset == "kda" else "none")
  cfg = ModelConfig(vocab_size=VOCAB, d_model=32, num_layers=len(pattern), pattern=pattern, recurrent=rec,
                    attention=att, mlp_ratio=2.0)
  return LanguageModel(cfg, rngs=nnx.Rngs(0))


def make_inputs(T, packed, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, VOCAB, size=(2, T)).astype(np.int32)
  seg = None
  if packed:
    # Row 0 restarts inside a slice (step 5) and on a slice boundary (step 24, slices of 8); row 1 never.
    seg = np.zeros((2, T), np.int32)
    seg[0, 5:] += 1
    seg[0, 24:] += 1
  cot = rng.normal(size=(2, T, VOCAB)).astype(np.float32)
  return tokens, seg, cot


def _child():
  """Runs in the child process: relative errors of every case, as JSON on the last line."""
  import jax
  from flax import nnx
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  from gdn.parallel import context_parallel_apply

  def fwd_bwd(apply, model, tokens, seg, cot, place, explicit=False):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def run(params, rest, tokens, seg, cot):
      logits, vjp = jax.vjp(lambda p: apply(nnx.merge(graphdef, p, rest), tokens, seg), params)
      # On an Explicit mesh the cotangent's type must carry the logits' sharding.
      return logits, vjp(jax.reshard(cot, jax.typeof(logits).sharding) if explicit else cot)[0]

    # Committed inputs: the host runtime has deadlocked in a collective fed with uncommitted host arrays.
    logits, grads = jax.jit(run)(*jax.device_put((params, rest, tokens, seg, cot), place))
    return np.asarray(logits), [np.asarray(g) for g in jax.tree.leaves(grads)]

  rel = lambda got, want: float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
  out = []
  for name, preset, pattern, D, Db, T, packed in CASES:
    model = make_model(preset, pattern)
    tokens, seg, cot = make_inputs(T, packed)
    one = lambda m, t, s: m(t, segment_ids=s)
    logits_ref, grads_ref = fwd_bwd(one, model, tokens, seg, cot, jax.devices()[0])
    if Db > 1:
      explicit = (jax.sharding.AxisType.Explicit,) * 2
      mesh, batch_axis = jax.make_mesh((Db, D), ("data", "seq"), axis_types=explicit), "data"
    else:
      mesh, batch_axis = Mesh(np.array(jax.devices()[:D]), ("seq",)), None
    cp = lambda m, t, s: context_parallel_apply(m, t, mesh, axis_name="seq", batch_axis_name=batch_axis,
                                                segment_ids=s)
    logits, grads = fwd_bwd(cp, model, tokens, seg, cot, NamedSharding(mesh, PartitionSpec()), explicit=Db > 1)
    assert len(grads) == len(grads_ref) and all(np.any(r) for r in grads_ref), "a parameter without gradient"
    errs = {"logits": rel(logits, logits_ref), "grads": max(rel(g, r) for g, r in zip(grads, grads_ref))}
    out.append({"case": name, "errors": errs})
  print(json.dumps(out))


@pytest.mark.slow
def test_logits_and_grads_match_single_device_on_cpu_devices():
  """Logits and the gradients of every parameter equal one device's, for each of CASES."""
  results = run_child(__file__)
  assert [r["case"] for r in results] == [c[0] for c in CASES]
  bad = [f"{r['case']}: {n} {e:.1e}" for r in results for n, e in r["errors"].items() if not e <= TOL]
  assert not bad, "relative error above {:.0e}:\n".format(TOL) + "\n".join(bad)


def _one_device_mesh(name="seq"):
  import jax
  from jax.sharding import Mesh

  return Mesh(np.array(jax.devices()[:1]), (name,))


@pytest.mark.parametrize("change, error, message", [
    (dict(axis_name="time"), ValueError, "axis_name='time' is not an axis of the mesh"),
    (dict(batch_axis_name="seq"), ValueError, "batch_axis_name must differ"),
    (dict(tokens=np.zeros((2, 8), np.float32)), ValueError, "integer array"),
    (dict(segment_ids=np.zeros((2, 9), np.int32)), ValueError, "segment_ids must be"),
    (dict(recurrent=dict(dropout=0.1)), ValueError, "active dropout"),
    (dict(recurrent=dict(beta="channel")), ValueError, "per-value-channel beta"),
    (dict(model="not a model"), TypeError, "LanguageModel"),
])
def test_bad_arguments_raise_clear_errors(change, error, message):
  from flax import nnx

  from gdn.config import ModelConfig, recurrent_preset
  from gdn.model import LanguageModel
  from gdn.parallel import context_parallel_apply

  kw = dict(model=make_model("gated_deltanet", "RRRA"), tokens=np.zeros((2, 8), np.int32), mesh=_one_device_mesh())
  change = dict(change)
  if "recurrent" in change:
    rec = recurrent_preset("gated_deltanet", num_heads=2, head_dim=16, **change.pop("recurrent"))
    kw["model"] = LanguageModel(ModelConfig(vocab_size=VOCAB, d_model=32, num_layers=1, pattern="R", recurrent=rec),
                                rngs=nnx.Rngs(0))
  kw.update(change)
  with pytest.raises(error, match=message):
    context_parallel_apply(**kw)


def test_caches_are_declined_under_context_parallelism():
  model = make_model("gated_deltanet", "RRRA")
  x = np.zeros((1, 4, 32), np.float32)
  for block in (model.blocks[0], model.blocks[3]):
    with pytest.raises(ValueError, match="cannot be combined with context_axis"):
      block.mixer(x, cache=block.init_cache(1, 8), context_axis="seq")


if __name__ == "__main__":
  _child()
