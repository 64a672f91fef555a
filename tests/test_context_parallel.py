"""Context-parallel gated delta rule on 2, 4 and 8 host CPU devices against the single-device op and the oracle.

Shapes: B batch, T time, H q/k heads, HV value heads, K key dim, V value dim, D devices on the sequence axis.

The device count of the CPU backend is fixed when jax first initialises it, which the rest of the suite does
before this file runs; the multi-device checks therefore run in a child process started with
`XLA_FLAGS=--xla_force_host_platform_device_count=8` (this file, run as a script), which prints its errors as
JSON for the test here to judge.
"""

import json
import sys

import numpy as np
import pytest

from devices import run_child

# The checks are math, not XLA's fusions: fewer optimisations compile faster (conftest.py).
pytestmark = pytest.mark.usefixtures("fast_compile")

B, T, H, HV, K, V, C = 2, 141, 1, 2, 8, 6, 16
# T = 8 * 18 - 3: slices of 18, 36 and 72 steps for D = 8, 4, 2 (each padded at the sequence end, none a
# multiple of C), so that a reset at step 72 falls on a slice boundary for every D and one at 18 for D = 8.
# Row 0 restarts at these steps (the segment from 72 spans slices); row 1 never does, so its initial state
# reaches every slice.
RESETS = (18, 41, 72)
TOL = 1e-5
# Each group is one child process, [(D, method, g_kind, beta_kind, mesh)]; a group shares its single-device
# references, so the groups split by beta. Together: every g x beta on 8 devices, both methods on 2 and 4,
# the diagonal (beta None) and full slice maps, and an Explicit 2 x 4 mesh with the batch split as well
# (and remat).
GROUPS = {
    "beta_none": ([(8, "chunk", g, "none", "auto") for g in ("none", "head", "channel")]
                  + [(4, "associative", "none", "none", "auto"), (2, "chunk", "channel", "none", "auto")]),
    "beta_head": ([(8, "chunk", g, "head", "auto") for g in ("none", "head", "channel")]
                  + [(4, "associative", "head", "head", "auto"), (2, "associative", "none", "head", "auto"),
                     (4, "chunk", "channel", "head", "explicit_2x4")]),
}
DIFF = ("q", "k", "v", "g", "beta", "initial_state")
# bfloat16 q, k, v, g, beta (the state stays float32), against one device on the same inputs: the slice maps'
# scan starts from the state's dtype, not the 16-bit chunk-local operands' (`_slice_map_sequential`).
BF16_CASES = [(2, "chunk", "head", "head", "auto"), (4, "chunk", "channel", "none", "auto")]
BF16_TOL = 2e-2


def make_inputs(g_kind, beta_kind, seed=0):
  rng = np.random.default_rng(seed)
  k = rng.normal(size=(B, T, H, K))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  x = dict(q=rng.normal(size=(B, T, H, K)), k=k, v=rng.normal(size=(B, T, HV, V)),
           g={"none": None, "head": np.log(rng.uniform(0.9, 1.0, (B, T, HV))),
              "channel": np.log(rng.uniform(0.9, 1.0, (B, T, HV, K)))}[g_kind],
           beta={"none": None, "head": rng.uniform(0, 2, (B, T, HV))}[beta_kind],
           initial_state=0.5 * rng.normal(size=(B, HV, K, V)))
  x = {n: None if a is None else a.astype(np.float32) for n, a in x.items()}
  seg = np.zeros((B, T), np.int32)
  for t in RESETS:
    seg[0, t:] += 1
  cot = (rng.normal(size=(B, T, HV, V)).astype(np.float32), rng.normal(size=(B, HV, K, V)).astype(np.float32))
  return x, seg, cot


def _child(group):
  """Runs in the child process: relative errors of every case of `group`, as JSON on the last line."""
  import jax
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  from gdn import ops
  from reference import gated_delta_rule_ref

  def fwd_bwd(f, x, seg, cot, place, **kw):
    names = [n for n in DIFF if x[n] is not None]

    def run(*arrays):
      (o, S), vjp = jax.vjp(lambda *a: f(**dict(zip(names, a)), segment_ids=seg, chunk_size=C, **kw), *arrays)
      return o, S, dict(zip(names, vjp(cot)))

    # Committed inputs: the host runtime has deadlocked in a collective fed with uncommitted host arrays.
    return jax.jit(run)(*jax.device_put([x[n] for n in names], place))

  rel = lambda got, want: float(np.max(np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32)))
                                / np.max(np.abs(np.asarray(want, np.float32))))
  refs, out = {}, []
  bf16 = group == "bfloat16"
  for D, method, g_kind, beta_kind, mesh_kind in BF16_CASES if bf16 else GROUPS[group]:
    x, seg, cot = make_inputs(g_kind, beta_kind)
    if bf16:
      x = {n: a if a is None or n == "initial_state" else a.astype(jax.numpy.bfloat16) for n, a in x.items()}
      cot = (cot[0].astype(jax.numpy.bfloat16), cot[1])
    if (g_kind, beta_kind) not in refs:
      o, S, grads = fwd_bwd(ops.gated_delta_rule, x, seg, cot, jax.devices()[0], method="chunk")
      o64, S64 = gated_delta_rule_ref(**x, segment_ids=seg)
      refs[g_kind, beta_kind] = (np.asarray(o), np.asarray(S), {n: np.asarray(a) for n, a in grads.items()},
                                 o64, S64)
    o_ref, S_ref, g_ref, o64, S64 = refs[g_kind, beta_kind]
    if mesh_kind == "explicit_2x4":
      mesh, batch_axis = jax.make_mesh((2, D), ("data", "seq")), "data"
    else:
      mesh, batch_axis = Mesh(np.array(jax.devices()[:D]), ("seq",)), None
    # The Explicit-mesh case also runs the rematerialised backward.
    o, S, grads = fwd_bwd(ops.context_parallel_gated_delta_rule, x, seg, cot, NamedSharding(mesh, PartitionSpec()),
                          mesh=mesh, axis_name="seq", batch_axis_name=batch_axis, method=method,
                          remat=batch_axis is not None)
    errs = {"o": rel(o, o_ref), "final_state": rel(S, S_ref)}
    if not bf16:
      errs.update({"o_vs_float64": rel(o, o64), "final_state_vs_float64": rel(S, S64)})
    errs.update({f"d{n}": rel(grads[n], g_ref[n]) for n in grads})
    out.append({"case": f"D={D} {method} g={g_kind} beta={beta_kind} mesh={mesh_kind}", "errors": errs})
  print(json.dumps(out))


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_matches_single_device_on_cpu_devices(group):
  """Outputs, final state and the gradients of q, k, v, g, beta, initial_state equal one device's."""
  results = run_child(__file__, group)
  assert len(results) == len(GROUPS[group])
  bad = [f"{r['case']}: {n} {e:.1e}" for r in results for n, e in r["errors"].items() if not e <= TOL]
  assert not bad, "relative error above {:.0e}:\n".format(TOL) + "\n".join(bad)


def test_bfloat16_inputs_match_single_device_on_cpu_devices():
  """16-bit inputs through the sequential slice maps (a float32 state carried from a bfloat16-operand stage)."""
  results = run_child(__file__, "bfloat16")
  assert len(results) == len(BF16_CASES)
  bad = [f"{r['case']}: {n} {e:.1e}" for r in results for n, e in r["errors"].items() if not e <= BF16_TOL]
  assert not bad, "relative error above {:.0e}:\n".format(BF16_TOL) + "\n".join(bad)


def _one_device_mesh():
  import jax
  from jax.sharding import Mesh

  return Mesh(np.array(jax.devices()[:1]), ("seq",))


def test_one_device_mesh_matches_oracle():
  """A mesh of one device is the plain op: no neighbour, no boundary (runs in this process)."""
  from gdn import ops
  from reference import gated_delta_rule_ref

  import jax

  x, seg, _ = make_inputs("head", "head", seed=1)
  run = jax.jit(lambda x, seg: ops.context_parallel_gated_delta_rule(
      **x, segment_ids=seg, mesh=_one_device_mesh(), axis_name="seq", chunk_size=C))
  o, S = run(x, seg)
  o64, S64 = gated_delta_rule_ref(**x, segment_ids=seg)
  np.testing.assert_allclose(o, o64, atol=TOL * np.abs(o64).max(), rtol=0)
  np.testing.assert_allclose(S, S64, atol=TOL * np.abs(S64).max(), rtol=0)


def test_one_device_mesh_with_a_bounded_gate():
  """g_lower_bound reaches each slice's chunk-local stage: the KDA op's bounded form, the same as the plain op's,
  and g below the bound is clamped as there."""
  from gdn import ops

  import jax

  x, seg, _ = make_inputs("channel", "head", seed=2)
  x = dict(x, g=np.where(np.arange(x["g"].size).reshape(x["g"].shape) % 7 == 0, -30.0, x["g"]).astype(np.float32))
  cp = jax.jit(lambda x, seg: ops.context_parallel_gated_delta_rule(
      **x, segment_ids=seg, mesh=_one_device_mesh(), axis_name="seq", chunk_size=C, g_lower_bound=-2.0))
  plain = jax.jit(lambda x, seg: ops.gated_delta_rule(**x, segment_ids=seg, chunk_size=C, method="chunk",
                                                       g_lower_bound=-2.0))
  unbounded_on_clamped = jax.jit(lambda x, seg: ops.gated_delta_rule(**x, segment_ids=seg, chunk_size=C))(
      dict(x, g=np.maximum(x["g"], -2.0)), seg)
  for got, want in ((cp(x, seg), plain(x, seg)), (cp(x, seg), unbounded_on_clamped)):
    for a, b in zip(got, want):
      np.testing.assert_allclose(a, b, atol=1e-5 * np.abs(b).max(), rtol=0)


@pytest.mark.parametrize("change, message", [
    (dict(beta=np.ones((B, T, HV, V), np.float32)), "per-value-channel beta"),
    (dict(method="recurrent"), "method must be one of"),
    (dict(axis_name="time"), "axis_name='time' is not an axis of the mesh"),
    (dict(batch_axis_name="seq"), "batch_axis_name must differ"),
    (dict(g=np.zeros((B, T, HV, V + 1), np.float32)), "g must be None"),
])
def test_bad_arguments_raise_clear_errors(change, message):
  from gdn import ops

  x, seg, _ = make_inputs("none", "head")
  kw = dict(x, segment_ids=seg, mesh=_one_device_mesh(), axis_name="seq")
  kw.update(change)
  with pytest.raises(ValueError, match=message):
    ops.context_parallel_gated_delta_rule(**kw)


if __name__ == "__main__":
  _child(sys.argv[1])
