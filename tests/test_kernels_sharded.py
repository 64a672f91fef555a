"""The chunk-local kernels (`pallas_local`: the fused forward, its backward kernels, LOCAL_SPLIT's three and the
solve; `pallas_diag`: KDA's diagonal sub-chunk blocks) under a batch-sharded jit and under `jax.vmap`.

Each kernel call is a `pallas_common.per_rows` op: with the batch split over devices, every device runs the kernels
on its own chunks and nothing is gathered (XLA cannot split a kernel call and would otherwise gather every operand
onto every device). The sharded check runs in a child process on 8 forced CPU devices (`devices.run_child`),
every kernel in Pallas' interpreter; the vmap check runs here.
"""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn import ops
from gdn.ops import intra_chunk, pallas_chunk, pallas_local
from devices import run_child
from test_ops import make_inputs, rel, vjp_inputs

# (name, g kind, switches as (module, attribute, value), kernels the calls must run): every kernel op of the two
# modules (`pallas_local`'s forward, backward and solve ops, the forward with T; `pallas_diag`'s two). FUSED_LOCAL
# puts pallas_local's kernel in the forward; a differentiated call runs it only with BACKWARD_KERNEL or SPLIT_VJP.
# The other kernel settings (BACKWARD_SPLIT, FUSED_LOCAL_CHANNEL) run inside the same ops.
CASES = [
    ("fused local, backward kernel", "head",
     [(pallas_chunk, "FUSED_LOCAL", True), (pallas_local, "BACKWARD_KERNEL", True)],
     ["gdn_chunk_local", "gdn_chunk_local_bwd"]),
    ("local split with its VJP", "head",
     [(pallas_chunk, "FUSED_LOCAL", True), (pallas_local, "LOCAL_SPLIT", True), (pallas_local, "SPLIT_VJP", True)],
     ["gdn_chunk_local_pairs", "gdn_chunk_local_solve", "gdn_chunk_local_apply"]),
    ("solve kernel in the XLA stage", "head", [(pallas_chunk, "FUSED_LOCAL", False), (intra_chunk, "SOLVE_KERNEL", True)],
     ["gdn_chunk_local_solve"]),
    ("KDA, diagonal-block kernel", "channel",
     [(pallas_chunk, "FUSED_LOCAL", False), (intra_chunk, "CHANNEL_DIAG_KERNEL", True)],
     ["gdn_channel_diag_blocks", "gdn_channel_diag_blocks_bwd"]),
]
CHUNK = 16  # the solve and the diagonal blocks take chunks of a multiple of 16


def _functions():
  """(forward, forward + VJP), jitted anew: the switches are read at trace time."""
  def op(d):
    return ops.gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=d["initial_state"],
                                method="pallas", chunk_size=CHUNK)

  def fwd_bwd(d, co):
    (o, S), vjp = jax.vjp(op, d)
    (grads,) = vjp((co[0].astype(o.dtype), co[1].astype(S.dtype)))
    return o, S, grads

  return jax.jit(op), jax.jit(fwd_bwd)


def _with(switches):
  """Sets the switches; returns a function that restores them."""
  old = [(m, a, getattr(m, a)) for m, a, _ in switches]
  for m, a, v in switches:
    setattr(m, a, v)
  return lambda: [setattr(m, a, v) for m, a, v in old]


def _sharded_child():
  """Per case: relative errors of the batch-sharded forward-only and differentiated calls against the same calls
  on one device, the all-gathers of their compiled modules, and whether o stays sharded."""
  from gdn.train.sharding import batch_sharding, make_mesh

  mesh = make_mesh(data=4, fsdp=2)
  rows = batch_sharding(mesh)
  out = []
  for name, g_kind, switches, kernels in CASES:
    x = make_inputs(41, 8, 40, 1, 2, 16, 12, g_kind, "head")  # T 40: two whole chunks of 16 and a padded one
    diff, _, co = vjp_inputs(x)
    restore = _with(switches)
    try:
      fwd, fwd_bwd = _functions()
      jaxprs = str(jax.make_jaxpr(fwd)(diff)) + str(jax.make_jaxpr(fwd_bwd)(diff, co))
      want_o, want_S = fwd(diff)  # uncommitted inputs: one device
      want = fwd_bwd(diff, co)
      d_s, co_s = jax.device_put((diff, co), rows)
      fwd_c, fwd_bwd_c = fwd.lower(d_s).compile(), fwd_bwd.lower(d_s, co_s).compile()  # each compiled once
      hlo = fwd_c.as_text() + fwd_bwd_c.as_text()
      o, S = fwd_c(d_s)
      got = fwd_bwd_c(d_s, co_s)
    finally:
      restore()
    errs = {"o": rel(np.asarray(o), np.asarray(want_o)), "final_state": rel(np.asarray(S), np.asarray(want_S)),
            "o (differentiated)": rel(np.asarray(got[0]), np.asarray(want[0]))}
    errs.update({f"d{n}": rel(np.asarray(got[2][n]), np.asarray(want[2][n])) for n in want[2]})
    out.append({"case": name, "errors": errs, "all_gathers": hlo.count("all-gather"),
                "kernels_missing": [n for n in kernels if not re.search(rf"\b{n}\b", jaxprs)],
                "o_stays_sharded": o.sharding.is_equivalent_to(rows, o.ndim)
                and got[0].sharding.is_equivalent_to(rows, o.ndim)})
  print(json.dumps(out))


@pytest.mark.slow
def test_batch_sharded_kernels_run_per_device():
  """With the batch split over an 8-device ("data", "fsdp") mesh, every chunk-local kernel path gives one
  device's outputs, final state and gradients, the compiled modules gather nothing and o stays sharded."""
  results = run_child(__file__)
  assert [r["case"] for r in results] == [c[0] for c in CASES]
  for r in results:
    bad = {n: e for n, e in r["errors"].items() if not e <= 1e-5}
    assert not bad, f"{r['case']}: relative error above 1e-5: {bad}"
    assert r["all_gathers"] == 0, f"{r['case']}: {r['all_gathers']} all-gathers in the compiled modules"
    assert r["o_stays_sharded"], r["case"]
    assert not r["kernels_missing"], f"{r['case']}: the calls ran none of {r['kernels_missing']}"


@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=lambda c: c[0])
def test_vmap_folds_the_mapped_axis_into_the_rows(case):
  """Under `jax.vmap` (sweep cells stacked by `gdn.train.train_stacked`) the kernels' `per_rows` ops fold the
  mapped axis into their rows: the vmapped forward and gradients equal each member's own call (the fused kernel
  with its backward kernel; KDA's diagonal blocks, forward and backward)."""
  name, g_kind, switches, kernels = case
  xs = [make_inputs(s, 1, 40, 1, 2, 16, 12, g_kind, "head", init=False) for s in (43, 44)]
  names = ("q", "k", "v", "g", "beta")

  def loss(*arrays):
    o, S = ops.gated_delta_rule(*arrays, method="pallas", chunk_size=CHUNK)
    return jnp.sum(o * o) + jnp.sum(jnp.sin(S))

  grad = jax.value_and_grad(loss, argnums=tuple(range(len(names))))
  stacked = [jnp.stack([jnp.asarray(x[n]) for x in xs]) for n in names]
  restore = _with(switches)
  try:
    jaxpr = str(jax.make_jaxpr(jax.vmap(grad))(*stacked))
    value, grads = jax.jit(jax.vmap(grad))(*stacked)
    wants = [jax.jit(grad)(*(jnp.asarray(x[n]) for n in names)) for x in xs]
  finally:
    restore()
  assert all(re.search(rf"\b{n}\b", jaxpr) for n in kernels), (name, kernels)
  for i, (want_value, want_grads) in enumerate(wants):
    assert rel(np.asarray(value[i]), np.asarray(want_value)) < 1e-6, name
    for n, got, want in zip(names, grads, want_grads):
      assert rel(np.asarray(got[i]), np.asarray(want)) < 1e-5, (name, n)


if __name__ == "__main__":
  _sharded_child()
