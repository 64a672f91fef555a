"""The fused chunk-local Pallas kernel (`gdn.ops.pallas_local`) against the XLA chunk-local stage
(`intra_chunk.local`), alone and inside `method="pallas"` (switch `pallas_chunk.FUSED_LOCAL` off / on).

(a) accuracy: max relative error of each field against `intra_chunk.local`, float32 and bfloat16, at one shape;
(b) time: median ms of the chunk-local stage (forward; backward alone: XLA's VJP from saved residuals vs the
    backward kernel) and of the whole op (forward, forward+backward) per shape, with FUSED_LOCAL off / on and
    with both FUSED_LOCAL and `pallas_local.BACKWARD_KERNEL` on ("bwd kernel": its two kernels of
    `pallas_local.BACKWARD_SPLIT` with --bwd-split).
Shapes are (B, T, H, D): H = HV heads, K = V = D, per-head beta, and per-head decay (`--decay head`, Gated
DeltaNet) or per-key-channel decay (`--decay channel`, KDA: its kernel switched
on here with `pallas_local.FUSED_LOCAL_CHANNEL` for the stage and for the op's "on" columns; the backward kernel
takes a per-head decay only, so its columns stay empty); a failing variant prints its error's last line and the
rest go on.

  python -m experiments.bench_local                       # the five issue-13 shapes, bfloat16
  python -m experiments.bench_local --decay channel --shapes 4,2048,16,128 2,16384,16,128 1,8192,96,128
  python -m experiments.bench_local --shapes 1,512,2,64 --check-shape 1,512,2,64 --reps 2   # a quick run
  python -m experiments.bench_local --check-shape '' --bwd-split      # the backward as two kernels
  python -m experiments.bench_local --check-shape '' --split --lowp-wu   # the forward as three kernels
  python -m experiments.bench_local --check-shape '' --split --lowp-wu --split-vjp   # and in training
"""

from __future__ import annotations

import argparse
import contextlib
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from gdn.bench.op_inputs import PRESETS, inputs
from gdn.bench.timing import timed
from gdn.ops import checks, chunk, gated_delta_rule, intra_chunk, pallas_chunk, pallas_local

FIELDS = ("q_dec", "k_end", "decay", "P", "W", "U")


def chunk_args(shape, dtype, decay, chunk_size=64):
  """The flat per-chunk inputs [L, C, ...] that `chunk.prepare` hands to the chunk-local stage (q scaled, in the
  operand dtype; g, beta float32), built from the op benchmark's inputs with g per head or per key channel
  (`decay`), and the caller's precision."""
  args, _ = inputs(shape, dtype, decay)
  dims = checks.check_sequence(*args, None, None, None, "chunk", chunk_size)
  seen = {}

  def capture(*x, **kw):  # prepare's call of the chunk-local stage: keep its inputs (the rest is dead code)
    seen["x"] = x[:5]
    return intra_chunk.local(*x, **kw)

  def flat(*a):
    chunk.prepare(*a, scale=dims.K**-0.5, segment_ids=None, dims=dims, chunk_size=chunk_size, local=capture)
    return seen["x"]

  return jax.jit(flat)(*args), chunk.precision_for(dtype)


def fields(loc):
  return tuple(getattr(loc, n) for n in FIELDS)


@contextlib.contextmanager
def switches(fused: bool, backward_kernel: bool = False):
  """FUSED_LOCAL, FUSED_LOCAL_CHANNEL (both `fused`) and BACKWARD_KERNEL set while a function is traced (they are
  read at trace time), restored after."""
  names = ((pallas_chunk, "FUSED_LOCAL"), (pallas_local, "FUSED_LOCAL_CHANNEL"), (pallas_local, "BACKWARD_KERNEL"))
  old = [getattr(m, n) for m, n in names]
  for (m, n), value in zip(names, (fused, fused, backward_kernel)):
    setattr(m, n, value)
  try:
    yield
  finally:
    for (m, n), value in zip(names, old):
      setattr(m, n, value)


def kernel_local(*a, **kw):
  """`pallas_local.local` through its kernel (the switches on; an error if the variant would fall back to XLA)."""
  with switches(True):
    assert pallas_local.supports(a[3], a[4], a[5], kw["beta_kind"], jnp.result_type(*a[:3])), "falls back to XLA"
    return pallas_local.local(*a, **kw)


def check(shape, decay):
  print(f"## accuracy against intra_chunk.local at B, T, H, D = {shape}, {decay} decay: max |got - want| / max "
        "|want|")
  print("| dtype | " + " | ".join(FIELDS) + " |")
  print("|---|" + "---|" * len(FIELDS))
  for dtype in (jnp.float32, jnp.bfloat16):
    try:
      x, prec = chunk_args(shape, dtype, decay)
      kw = dict(beta_kind="head", prec=prec)
      want = jax.jit(lambda *a: fields(intra_chunk.local(*a, None, **kw)))(*x)
      got = jax.jit(lambda *a: fields(kernel_local(*a, None, **kw)))(*x)
      errs = []
      for a, b in zip(got, want):
        a, b = np.asarray(a.astype(jnp.float32), np.float64), np.asarray(b.astype(jnp.float32), np.float64)
        errs.append(f"{np.abs(a - b).max() / max(np.abs(b).max(), 1e-30):.2e}")
      print(f"| {jnp.dtype(dtype).name} | " + " | ".join(errs) + " |", flush=True)
    except Exception as e:  # report and go on
      print(f"| {jnp.dtype(dtype).name} | failed: {_last_line(e)} |", flush=True)


def _last_line(e):
  lines = [l for l in "".join(traceback.format_exception_only(type(e), e)).strip().splitlines() if l.strip()]
  return lines[-1][:200] if lines else type(e).__name__


def op_fn(fused: bool, backward_kernel: bool = False):
  """`gated_delta_rule(method="pallas")` traced with FUSED_LOCAL, FUSED_LOCAL_CHANNEL and BACKWARD_KERNEL set as
  asked (`switches`)."""

  def f(q, k, v, g, b):
    with switches(fused, backward_kernel):
      return gated_delta_rule(q, k, v, g, b, method="pallas", chunk_size=64)[0]

  return f


def stage_backward(x, prec):
  """{name: (fn, args)}: the stage's backward alone, XLA's VJP of `intra_chunk.local` from residuals saved by a
  separate call, and the backward kernel (which recomputes what it needs from the inputs), for the same random
  cotangents of (q_dec, k_end, P, W, U)."""
  outs, vjp = jax.jit(lambda *a: jax.vjp(lambda *b: pallas_local.reference(prec, *b), *a))(*x)
  rng = np.random.default_rng(0)
  cts = tuple(jnp.asarray(rng.normal(size=o.shape), o.dtype) for o in outs)
  interpret = pallas_chunk.default_interpret()
  cfg = pallas_local.make_config(prec, interpret, bwd_kernel=True)
  return {"local bwd xla": (jax.jit(lambda vjp, cts: vjp(cts)), (vjp, cts)),
          "local bwd kernel": (jax.jit(lambda x, cts: pallas_local.backward_kernel(cfg, *x, cts)), (tuple(x), cts))}


def time_shape(shape, dtype, decay, reps, bwd_kernel: bool = True):
  """{variant: ms or error line}; the backward kernel's variants only for a per-head decay and with `bwd_kernel`."""
  row = {}

  def run(name, thunk):
    try:
      row[name] = f"{thunk():.2f}"
    except Exception as e:  # one failing variant must not hide the others
      row[name] = f"failed: {_last_line(e)}"
    print(f"  {shape} {name}: {row[name]}", flush=True)

  x, prec = chunk_args(shape, dtype, decay)
  kw = dict(beta_kind="head", prec=prec)
  run("local xla", lambda: timed(jax.jit(lambda *a: fields(intra_chunk.local(*a, None, **kw))), x, reps))
  run("local pallas", lambda: timed(jax.jit(lambda *a: fields(kernel_local(*a, None, **kw))), x, reps))
  try:
    for name, (fn, fargs) in stage_backward(x, prec).items():
      if (decay == "head" and bwd_kernel) or name == "local bwd xla":
        run(name, lambda: timed(fn, fargs, reps))
  except Exception as e:  # report and go on
    row["local bwd xla"] = f"failed: {_last_line(e)}"
    print(f"  {shape} local bwd: {row['local bwd xla']}", flush=True)
  args, rng = inputs(shape, dtype, decay)
  do = jnp.asarray(rng.normal(size=args[2].shape), dtype)
  for fused, kernel in ((False, False), (True, False), (True, True))[:3 if decay == "head" and bwd_kernel else 2]:
    f = op_fn(fused, kernel)

    def fwd_bwd(*a, f=f):
      _, vjp = jax.vjp(f, *a)
      return vjp(do)

    tag = "bwd kernel" if kernel else "on" if fused else "off"
    if not kernel:  # the forward does not change with BACKWARD_KERNEL
      run(f"op fwd {tag}", lambda: timed(jax.jit(f), args, reps))
    run(f"op fwd+bwd {tag}", lambda: timed(jax.jit(fwd_bwd), args, reps))
  return row


COLUMNS = ("local xla", "local pallas", "local bwd xla", "local bwd kernel", "op fwd off", "op fwd on",
           "op fwd+bwd off", "op fwd+bwd on", "op fwd+bwd bwd kernel")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
  p.add_argument("--decay", choices=["head", "channel"], default="head",
                 help="per-head g (Gated DeltaNet) or per-key-channel g (KDA, `_channel_kernel`)")
  p.add_argument("--reps", type=int, default=10)
  p.add_argument("--shapes", nargs="*", help="B,T,H,D each; default: the h200 preset's five")
  p.add_argument("--check-shape", default="4,4096,16,128", help="B,T,H,D of the accuracy check ('' skips it)")
  p.add_argument("--block-k", type=int, default=pallas_local.BLOCK_K, help="pallas_local.BLOCK_K")
  p.add_argument("--channel-block-k", type=int, default=pallas_local.CHANNEL_BLOCK_K,
                 help="pallas_local.CHANNEL_BLOCK_K (--decay channel)")
  p.add_argument("--channel-num-warps", type=int, default=pallas_local.CHANNEL_NUM_WARPS,
                 help="pallas_local.CHANNEL_NUM_WARPS (--decay channel)")
  p.add_argument("--block-v", type=int, default=pallas_local.BLOCK_V, help="pallas_local.BLOCK_V")
  p.add_argument("--num-warps", type=int, default=pallas_local.NUM_WARPS, help="pallas_local.NUM_WARPS")
  p.add_argument("--num-stages", type=int, default=pallas_local.NUM_STAGES, help="pallas_local.NUM_STAGES")
  p.add_argument("--bwd-block-k", type=int, default=pallas_local.BWD_BLOCK_K, help="pallas_local.BWD_BLOCK_K")
  p.add_argument("--bwd-block-v", type=int, default=pallas_local.BWD_BLOCK_V, help="pallas_local.BWD_BLOCK_V")
  p.add_argument("--bwd-num-warps", type=int, default=pallas_local.BWD_NUM_WARPS, help="pallas_local.BWD_NUM_WARPS")
  p.add_argument("--bwd-split", action="store_true",
                 help="pallas_local.BACKWARD_SPLIT: the \"bwd kernel\" columns time the backward's two kernels")
  p.add_argument("--split-block-k", type=int, default=pallas_local.SPLIT_BLOCK_K, help="pallas_local.SPLIT_BLOCK_K")
  p.add_argument("--split-num-warps", type=int, default=pallas_local.SPLIT_NUM_WARPS,
                 help="pallas_local.SPLIT_NUM_WARPS")
  p.add_argument("--split", action="store_true", help="pallas_local.LOCAL_SPLIT: the forward as three kernels")
  p.add_argument("--split-fwd-warps", default=",".join(map(str, pallas_local.SPLIT_FWD_WARPS)),
                 help="pallas_local.SPLIT_FWD_WARPS: warps of the three forward kernels of --split")
  p.add_argument("--lowp-wu", action=argparse.BooleanOptionalAction, default=None,
                 help="pallas_local.LOWP_WU: W and U on 16-bit operands (default: the module's, on)")
  p.add_argument("--no-bwd-kernel", action="store_true", help="leave out the backward kernel's two columns")
  p.add_argument("--split-vjp", action="store_true",
                 help="pallas_local.SPLIT_VJP: with --split, differentiated calls run the three kernels and "
                      "intra_chunk.local_vjp (the \"op fwd+bwd on\" column)")
  a = p.parse_args(argv)
  pallas_local.LOCAL_SPLIT = pallas_local.LOCAL_SPLIT or a.split
  warps = a.split_fwd_warps.split(",")
  if len(warps) != 3 or not all(w.isdigit() and int(w) > 0 for w in warps):
    p.error(f"--split-fwd-warps takes three positive warp counts P,S,A, got {a.split_fwd_warps!r}")
  pallas_local.SPLIT_FWD_WARPS = tuple(map(int, warps))
  if a.lowp_wu is not None:
    pallas_local.LOWP_WU = a.lowp_wu
  pallas_local.SPLIT_VJP = pallas_local.SPLIT_VJP or a.split_vjp
  pallas_local.BLOCK_K, pallas_local.BLOCK_V = a.block_k, a.block_v
  pallas_local.CHANNEL_BLOCK_K, pallas_local.CHANNEL_NUM_WARPS = a.channel_block_k, a.channel_num_warps
  pallas_local.BWD_BLOCK_K, pallas_local.BWD_BLOCK_V = a.bwd_block_k, a.bwd_block_v
  pallas_local.BWD_NUM_WARPS = a.bwd_num_warps
  pallas_local.BACKWARD_SPLIT = pallas_local.BACKWARD_SPLIT or a.bwd_split
  pallas_local.SPLIT_BLOCK_K, pallas_local.SPLIT_NUM_WARPS = a.split_block_k, a.split_num_warps
  pallas_local.NUM_WARPS, pallas_local.NUM_STAGES = a.num_warps, a.num_stages
  print(f"# chunk-local stage: XLA vs fused Pallas, {jax.devices()[0].device_kind}, jax {jax.__version__}, "
        f"{a.decay} decay, chunk 64, median of {a.reps}; FUSED_LOCAL default {pallas_chunk.FUSED_LOCAL}, "
        f"FUSED_LOCAL_CHANNEL default {pallas_local.FUSED_LOCAL_CHANNEL}; kernel block_k {a.block_k} (channel "
        f"{a.channel_block_k}, {a.channel_num_warps} warps), "
        f"block_v {a.block_v}, {a.num_warps} warps, {a.num_stages} stages; backward kernel blocks {a.bwd_block_k}, "
        f"{a.bwd_block_v}, {a.bwd_num_warps} warps; BACKWARD_SPLIT {pallas_local.BACKWARD_SPLIT} (second kernel "
        f"{a.split_block_k} keys, {a.split_num_warps} warps); LOCAL_SPLIT {pallas_local.LOCAL_SPLIT} (warps "
        f"{pallas_local.SPLIT_FWD_WARPS}, SPLIT_VJP {pallas_local.SPLIT_VJP}), LOWP_WU {pallas_local.LOWP_WU}")
  if a.check_shape:
    check(tuple(map(int, a.check_shape.split(","))), a.decay)
  shapes = [tuple(map(int, s.split(","))) for s in a.shapes] if a.shapes else PRESETS["h200"]["shapes"]
  dtype = jnp.dtype(a.dtype)
  rows = []
  for shape in shapes:
    rows.append((shape, time_shape(shape, dtype, a.decay, a.reps, bwd_kernel=not a.no_bwd_kernel)))
  print(f"## median ms, {a.dtype}, {a.decay} decay: chunk-local stage forward (XLA, Pallas) and backward alone (XLA VJP, kernel), "
        "whole op method='pallas' with FUSED_LOCAL off / on / on with BACKWARD_KERNEL")
  print("| B, T, H, D | " + " | ".join(COLUMNS) + " | local speedup | local bwd speedup | fwd+bwd speedup (on, bwd "
        "kernel; over off) |")
  print("|---|" + "---|" * (len(COLUMNS) + 3))
  for shape, row in rows:
    ratio = lambda x, y: (f"{float(row[x]) / float(row[y]):.2f}x"
                          if all(not row.get(n, "f").startswith("f") for n in (x, y)) else "-")
    print(f"| {', '.join(map(str, shape))} | " + " | ".join(row.get(c, "-") for c in COLUMNS)
          + f" | {ratio('local xla', 'local pallas')} | {ratio('local bwd xla', 'local bwd kernel')} | "
          f"{ratio('op fwd+bwd off', 'op fwd+bwd on')}, {ratio('op fwd+bwd off', 'op fwd+bwd bwd kernel')} |",
          flush=True)


if __name__ == "__main__":
  main()
