"""The KDA diagonal-block kernels (`gdn.ops.pallas_diag`) alone, against XLA's dyadic levels below 16 steps that
they replace (`intra_chunk._pair_channel_dyadic` on chunks of 16 positions with `CHANNEL_DIAG_KERNEL` off), over
the kernels' settings: the exponents by scans or running sums (`pallas_diag.RUNNING_SUMS`), the warps of both
programs (`NUM_WARPS`, `BWD_NUM_WARPS`) and the keys a program takes (`BLOCK_K`, `BWD_BLOCK_K`, both set to the
same --block-k value: "all" one program per sub-chunk, a number a grid over slices of that many keys) and the
backward's sums over a column's rows (`BWD_ROW_LOOP`, --bwd-row-loop: off, reduced across the rows at every
column; on, a second loop over the rows). Every combination of --running, --warps, --block-k and --bwd-row-loop
is one variant (the second loop needs running sums: with scans it is left out).

Shapes are (B, T, H, D): B * H * T / 16 sub-chunks of 16 positions, K = D; q, k in --dtype, g float32 log-decays
drawn in [log 0.9, 0] as the op benchmarks draw them. Per variant: median ms of the forward (A and P) and of the
forward+backward (the value of <A, 1> + <P, 1> and its gradient with respect to q, k and g: the value keeps the
forward in the program, since the kernels' backward reads only q, k and g and a gradient alone would leave the
forward kernel dead code), and the largest relative error of
A, P and of the gradients against XLA's float32 levels at HIGHEST precision. A variant that fails prints its
error's last line and the rest go on.

With --resources, nothing runs: each setting's two kernels are compiled offline for sm_90 with the installed
Triton (`gdn.bench.kernel_resources`, any host) and their registers, spills and shared memory printed.

  python -m experiments.bench_diag                                    # two shapes, every setting, bfloat16
  python -m experiments.bench_diag --running on --warps 2,4,8 --block-k all,64,32   # running sums, key slices
  python -m experiments.bench_diag --running on --warps 4,8 --bwd-row-loop off,on   # the backward's two loops
  python -m experiments.bench_diag --shapes 1,128,1,32 --warps 4 --reps 1   # CPU smoke (the interpreter)
  python -m experiments.bench_diag --resources                        # registers and spills, no GPU needed
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from gdn.bench.op_fns import rel_err
from gdn.bench.timing import timed
from gdn.ops import intra_chunk, pallas_diag
from gdn.ops.pallas_common import default_interpret


def sub_chunks(shape, dtype, seed=0):
  """q, k [R, 16, D] in `dtype` and g [R, 16, D] float32 for the B * H * T / 16 sub-chunks of `shape`."""
  B, T, H, D = shape
  if T % pallas_diag.SUB:
    raise ValueError(f"T must be a multiple of {pallas_diag.SUB}, got {shape}")
  R = B * H * T // pallas_diag.SUB
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(R, pallas_diag.SUB, D)) / np.sqrt(D)
  k = rng.normal(size=(R, pallas_diag.SUB, D))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  g = np.log(rng.uniform(0.9, 1.0, (R, pallas_diag.SUB, D)))
  return jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(g, jnp.float32)


def programs(blocks):
  """(forward, forward+backward) jitted for `blocks(q, k, g) -> (A, P)`; the second returns the loss and its
gradients (the loss so that the forward runs in it: the kernels' backward does not need its outputs)."""
  def loss(q, k, g):
    A, P = blocks(q, k, g)
    return A.sum() + P.sum()
  return jax.jit(blocks), jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def xla_levels(prec):
  """XLA's levels below 16 (the dyadic form on chunks of 16 positions, the kernel off)."""
  def blocks(q, k, g):
    A, P = intra_chunk.channel_pairs(q, k, g, prec)
    return A[:, None], P[:, None]  # [R, 1, 16, 16], the kernel's layout
  return blocks


@contextlib.contextmanager
def kept():
  """Puts the module settings that the variants change back as they were on leaving."""
  settings = [(intra_chunk, "CHANNEL_DIAG_KERNEL")] + [
      (pallas_diag, n) for n in ("RUNNING_SUMS", "NUM_WARPS", "BWD_NUM_WARPS", "BLOCK_K", "BWD_BLOCK_K",
                                 "BWD_ROW_LOOP")]
  saved = [(m, n, getattr(m, n)) for m, n in settings]
  try:
    yield
  finally:
    for m, n, v in saved:
      setattr(m, n, v)


def settings(running, warps, blocks, row_loops=(False,)):
  """Every (RUNNING_SUMS, warps, key block, BWD_ROW_LOOP) combination, key block None for all keys; the second loop
  only with running sums (it forms its exponents that way)."""
  return [c for c in itertools.product(running, warps, blocks, row_loops) if c[0] or not c[3]]


def setting_name(running, w, bk, row_loop=False) -> str:
  keys = "" if bk is None else f", keys by {bk}"
  loops = ", two-loop backward" if row_loop else ""
  return f"kernel, {'running sums' if running else 'scans'}, {w} warps{keys}{loops}"


def apply(running, w, bk, row_loop=False):
  pallas_diag.RUNNING_SUMS, pallas_diag.NUM_WARPS, pallas_diag.BWD_NUM_WARPS = running, w, w
  pallas_diag.BLOCK_K = pallas_diag.BWD_BLOCK_K = bk
  pallas_diag.BWD_ROW_LOOP = row_loop


def measure(shape, dtype, combos, reps, prec):
  """Rows of (variant, fwd ms, fwd+bwd ms, err A, err P, err grads)."""
  args = sub_chunks(shape, dtype)
  rows = []
  with kept():
    intra_chunk.CHANNEL_DIAG_KERNEL = False
    ref_f, ref_g = programs(xla_levels(jax.lax.Precision.HIGHEST))
    want, want_g = ref_f(*args), ref_g(*args)[1]
    variants = [("XLA levels", None)] + [(setting_name(*c), c) for c in combos]
    interpret = default_interpret()
    for name, combo in variants:
      try:
        if combo is None:
          fwd, both = programs(xla_levels(prec))
        else:
          apply(*combo)
          fwd, both = programs(lambda q, k, g: pallas_diag.diag_blocks(q, k, g, interpret))
        got, got_g = fwd(*args), both(*args)[1]
        errs = (rel_err(got[0], want[0]), rel_err(got[1], want[1]),
                max(rel_err(a, b) for a, b in zip(got_g, want_g)))
        rows.append((name, timed(fwd, args, reps), timed(both, args, reps)) + errs)
      except Exception as e:  # a variant that does not compile or run: say why, time the rest
        rows.append((name, None, None, None, None, None))
        print(f"# {name}: {traceback.format_exception_only(type(e), e)[-1].strip()}")
  return rows


def resources_table(dtype, combos, K=128) -> list:
  """Rows of (RUNNING_SUMS, warps, key block, BWD_ROW_LOOP, kernel, resources dict) for both kernels at every
  setting, compiled offline for sm_90 (a program's tile does not depend on the shape, so one small shape stands
  for all)."""
  from gdn.bench.kernel_resources import resources, triton_kernels

  x = jax.ShapeDtypeStruct((4, 64, K), dtype)
  g = jax.ShapeDtypeStruct((4, 64, K), jnp.float32)
  ct = jax.ShapeDtypeStruct((4, 4, pallas_diag.SUB, pallas_diag.SUB), jnp.float32)
  rows = []
  with kept():
    for running, w, bk, row_loop in combos:
      apply(running, w, bk, row_loop)

      def both(q, k, g, a, p):  # a new function each time: jit caches by function, and the settings are read at trace
        out, vjp = jax.vjp(lambda *x: pallas_diag.diag_blocks(*x, False), q, k, g)
        return out, vjp((a, p))  # the forward's outputs too: an unused kernel op is dropped
      for kernel in triton_kernels(jax.jit(both), x, x, g, ct, ct):
        rows.append((running, w, bk, row_loop, kernel.name, resources(kernel)))
  return rows


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--shapes", nargs="*", default=["4,2048,16,128", "2,16384,16,128"], help="B,T,H,D each")
  p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="q and k")
  p.add_argument("--running", default="off,on", help="RUNNING_SUMS settings to try: off, on or off,on")
  p.add_argument("--warps", default="1,2,4,8", help="the kernels' warps to try, comma-separated")
  p.add_argument("--bwd-row-loop", default="off", help="BWD_ROW_LOOP settings to try: off, on or off,on")
  p.add_argument("--block-k", default="all",
                 help="keys a program takes (BLOCK_K and BWD_BLOCK_K), comma-separated: all, or powers of two >= 16")
  p.add_argument("--reps", type=int, default=20)
  p.add_argument("--resources", action="store_true",
                 help="print the kernels' registers, spills and shared memory for sm_90 (offline, any host) and exit")
  a = p.parse_args(argv)
  flags = {"off": False, "on": True}
  for name, value in (("--running", a.running), ("--bwd-row-loop", a.bwd_row_loop)):
    if any(r not in flags for r in value.split(",")):
      p.error(f"{name} takes off, on or off,on, got {value!r}")
  try:
    blocks = [None if b == "all" else int(b) for b in a.block_k.split(",")]
  except ValueError:
    p.error(f"--block-k takes 'all' or powers of two >= 16, comma-separated, got {a.block_k!r}")
  if any(b is not None and (b < pallas_diag.SUB or b & (b - 1)) for b in blocks):
    p.error(f"--block-k takes 'all' or powers of two >= 16, got {a.block_k!r}")
  try:
    warps = [int(w) for w in a.warps.split(",")]
  except ValueError:
    warps = [0]
  if any(w < 1 or w & (w - 1) for w in warps):
    p.error(f"--warps takes powers of two (Triton's warps a program), comma-separated, got {a.warps!r}")
  combos = settings([flags[r] for r in a.running.split(",")], warps, blocks,
                    [flags[r] for r in a.bwd_row_loop.split(",")])
  dtype = jnp.dtype(a.dtype)
  if a.resources:
    print(f"# pallas_diag's kernels compiled offline for sm_90 (the installed Triton, its ptxas -v); {a.dtype} q, k, "
          "float32 g, K = 128")
    print("| RUNNING_SUMS | warps | keys a program | BWD_ROW_LOOP | kernel | registers | spill stores B | "
          "spill loads B | shared KiB |")
    print("|---|---:|---:|---|---|---:|---:|---:|---:|")
    rows = resources_table(dtype, combos)
    onoff = lambda x: "on" if x else "off"
    for running, w, bk, row_loop, name, r in rows:
      print(f"| {onoff(running)} | {w} | {'all' if bk is None else bk} | {onoff(row_loop)} | {name} | "
            f"{r['registers']} | {r['spill_stores']} | {r['spill_loads']} | {r['shared'] / 1024:.0f} |")
    return rows
  prec = jax.lax.Precision.DEFAULT if dtype.itemsize == 2 else jax.lax.Precision.HIGHEST
  print(f"# pallas_diag against XLA's dyadic levels below 16; {jax.devices()[0].device_kind}, jax {jax.__version__}; "
        f"{a.dtype} q, k, float32 g; median of {a.reps}; errors against XLA's float32 levels at HIGHEST")
  out = {}
  for s in a.shapes:
    shape = tuple(int(x) for x in s.split(","))
    print(f"\n## (B, T, H, D) = {shape}: {shape[0] * shape[2] * shape[1] // pallas_diag.SUB:,} sub-chunks of 16 x "
          f"{shape[3]}")
    print("| variant | fwd ms | fwd+bwd ms | rel err A | rel err P | rel err grads |")
    print("|---|---:|---:|---:|---:|---:|")
    rows = measure(shape, dtype, combos, a.reps, prec)
    fmt = lambda x, f: "-" if x is None else format(x, f)
    for name, f, b, ea, ep, eg in rows:
      print(f"| {name} | {fmt(f, '.3f')} | {fmt(b, '.3f')} | {fmt(ea, '.1e')} | {fmt(ep, '.1e')} | {fmt(eg, '.1e')} |")
    out[shape] = rows
  return out


if __name__ == "__main__":
  main()
