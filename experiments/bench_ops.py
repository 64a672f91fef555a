"""Op benchmark: recurrent vs chunk vs associative vs pallas (and a plain XLA port), forward and forward+backward.

Prints a markdown table of median milliseconds and XLA's peak-memory estimate per variant, side by side in
one run, and on a GPU the time as a percentage of the H200's roofline floor (`roofline`: FLOP and bytes written
out). Shapes are (B, T, H, D): H = HV heads, K = V = D, per-head decay and beta (Gated DeltaNet).

  python -m experiments.bench_ops --preset cpu
  python -m experiments.bench_ops --preset h200 --dtype bfloat16
  python -m experiments.bench_ops --preset memory      # forward+backward memory with and without remat
  python -m experiments.bench_ops --preset long        # many chunks, little batch: chunk vs associative
  python -m experiments.bench_ops --methods chunk pallas --shapes 1,512,2,64   # any methods and shapes
  python -m experiments.bench_ops --breakdown --dtype bfloat16 --shapes 4,4096,64,128   # where pallas' time goes
  python -m experiments.bench_ops --preset h200 --dtype bfloat16 --fused-output off,on   # pallas_chunk.FUSED_OUTPUT
  python -m experiments.bench_ops --preset h200 --dtype bfloat16 --switch intra_chunk.INVERSE_VJP=off,on

"pallas" is in the GPU presets only: on CPU its kernels run in Pallas' interpreter, which times nothing useful.
"""

from __future__ import annotations

import argparse
import importlib

import jax
import jax.numpy as jnp

from experiments.cli import SETTINGS, takes
from gdn.bench.op_inputs import PRESETS, inputs
from gdn.bench.op_fns import make_fn, vjp_of
from gdn.bench.roofline import floor_ms
from gdn.bench.timing import peak_bytes, timed
from gdn.ops import checks, gated_delta_rule, stages


def pallas_with(switches):
  """`gated_delta_rule(method="pallas")`'s output as a function of (q, k, v, g, beta), traced with the module
  switches {(module, name): value} set (the op reads them at trace time) and restored after."""

  def f(q, k, v, g, b):
    old = {key: getattr(*key) for key in switches}
    for (module, name), value in switches.items():
      setattr(module, name, value)
    try:
      return gated_delta_rule(q, k, v, g, b, method="pallas", chunk_size=64)[0]
    finally:
      for (module, name), value in old.items():
        setattr(module, name, value)

  return f


def bench(shape, method, dtype, reps, skip_time=False, f=None):
  """fwd_ms, fb_ms, fwd_mem, fb_mem of `method` (or of the function `f` of (q, k, v, g, beta) given instead)."""
  args, rng = inputs(shape, dtype)
  B, T, H, D = shape
  dims = checks.check_sequence(*args, None, None, None, "chunk", 64)
  f = f or make_fn(method, dims)
  do = jnp.asarray(rng.normal(size=(B, T, H, D)), dtype)

  def fwd_bwd(*a):
    o, vjp = jax.vjp(f, *a)
    return vjp(do)

  fwd, fb = jax.jit(f), jax.jit(fwd_bwd)
  row = dict(fwd_mem=peak_bytes(fwd, args), fb_mem=peak_bytes(fb, args))
  if not skip_time:
    row.update(fwd_ms=timed(fwd, args, reps), fb_ms=timed(fb, args, reps))
  return row


# The stages of method="pallas" as prefixes of it: each prefix's outputs are what the next stage reads.
STAGES = ("prepare", "state pass", "finish")


def pallas_prefixes():
  """Three functions of (q, k, v, g, beta): `pallas` cut after each of its stages (`gdn.ops.stages`). `prepare` is
  the XLA chunk-local work (decays, A, its inverse, W, U, P), `state pass` the Pallas kernel (with its padding),
  `finish` the XLA output (Q S_in + P U). The last returns the op's output, as `gated_delta_rule(method="pallas")`."""

  def stage1(*a):
    loc = stages.prepare(*a).local  # only the fields the later stages read, so that no dead work is timed
    return loc.q_dec, loc.k_end, loc.decay, loc.P, loc.W, loc.U

  def stage2(*a):
    p = stages.prepare(*a)
    _, S_in, U = stages.state_pass(p, method="pallas")
    return p.local.q_dec, p.local.P, S_in, U

  def stage3(*a):
    p = stages.prepare(*a)
    _, S_in, U = stages.state_pass(p, method="pallas")
    return stages.finish(p, S_in, U).astype(a[2].dtype)

  return stage1, stage2, stage3


def breakdown(shape, dtype, reps):
  """Times `pallas` cut after each stage, forward and forward+backward (the backward of a prefix is taken
  with fixed random cotangents for its outputs); a stage's cost is the difference of consecutive prefixes."""
  args, rng = inputs(shape, dtype)
  rows = []
  for name, f in zip(STAGES, pallas_prefixes()):
    cts = jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s.shape), s.dtype), jax.eval_shape(f, *args))
    rows.append(dict(stage=name, fwd_ms=timed(jax.jit(f), args, reps),
                     fb_ms=timed(jax.jit(vjp_of(f)), [cts] + args, reps)))
  return rows


def print_breakdown(shapes, dtype, reps):
  print("| B, T, H, D | up to stage | fwd ms | fwd+bwd ms | stage fwd ms | stage fwd+bwd ms |")
  print("|---|---|---|---|---|---|")
  for shape in shapes:
    prev = dict(fwd_ms=0.0, fb_ms=0.0)
    for r in breakdown(shape, dtype, reps):
      print(f"| {', '.join(map(str, shape))} | {r['stage']} | {r['fwd_ms']:.2f} | {r['fb_ms']:.2f} | "
            f"{r['fwd_ms'] - prev['fwd_ms']:.2f} | {r['fb_ms'] - prev['fb_ms']:.2f} |", flush=True)
      prev = r


def print_switch(shapes, dtype, reps, module, name, settings):
  """method='pallas' with the module switch `gdn.ops.<module>.<name>` at each setting (off, on, auto) side by
  side, one process: median ms forward and forward+backward, XLA's forward memory estimate, and each setting's
  time over the first's. The switch is restored after each trace."""
  mod = importlib.import_module(f"gdn.ops.{module}")
  if not hasattr(mod, name):
    raise SystemExit(f"--switch: gdn.ops.{module} has no setting {name}")
  first, rest = settings[0], settings[1:]
  cols = ([f"fwd ms {s}" for s in settings] + [f"fwd {s} / {first}" for s in rest]
          + [f"fwd+bwd ms {s}" for s in settings] + [f"fwd+bwd {s} / {first}" for s in rest]
          + [f"fwd mem MiB {s}" for s in settings])
  print(f"# {module}.{name} at {', '.join(settings)}")
  print("| B, T, H, D | " + " | ".join(cols) + " |")
  print("|---|" + "---|" * len(cols))
  for shape in shapes:
    rows = {}
    for s in settings:
      try:
        rows[s] = bench(shape, "pallas", dtype, reps, f=pallas_with({(mod, name): SETTINGS[s]}))
      except Exception as e:  # report and go on: one failing setting must not hide the others
        print(f"  {shape} {name} {s}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
    cell = lambda s, key, scale=1: f"{rows[s][key] / scale:.2f}" if s in rows else "failed"
    ratio = lambda s, key: f"{rows[s][key] / rows[first][key]:.2f}" if s in rows and first in rows else "-"
    cells = ([cell(s, "fwd_ms") for s in settings] + [ratio(s, "fwd_ms") for s in rest]
             + [cell(s, "fb_ms") for s in settings] + [ratio(s, "fb_ms") for s in rest]
             + [cell(s, "fwd_mem", 2**20) for s in settings])
    print(f"| {', '.join(map(str, shape))} | " + " | ".join(cells) + " |", flush=True)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
  p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
  p.add_argument("--methods", nargs="*", help="override the preset's methods")
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--shapes", nargs="*", help="override the preset's shapes, each as B,T,H,D")
  p.add_argument("--breakdown", action="store_true",
                 help="time method='pallas' cut after each of its stages (prepare, state pass, finish)")
  p.add_argument("--fused-output", metavar="off,on",
                 help="time method='pallas' with pallas_chunk.FUSED_OUTPUT at each of these settings (off, on, "
                      "auto = None) side by side, with the ratios to the first")
  p.add_argument("--switch", metavar="MODULE.NAME=off,on",
                 help="the same for any module switch of gdn.ops, e.g. intra_chunk.INVERSE_VJP=off,on")
  a = p.parse_args(argv)
  preset = PRESETS[a.preset]
  methods = a.methods or preset["methods"]
  dtype = jnp.dtype(a.dtype)
  print(f"# gated delta rule ops, {jax.devices()[0].device_kind}, jax {jax.__version__}, {a.dtype} inputs, "
        f"chunk 64, median of {a.reps}")
  # The floor is the H200's: a percentage of it means something on that card (or one like it) only.
  on_gpu = jax.default_backend() == "gpu"
  shapes = [tuple(map(int, s.split(","))) for s in a.shapes] if a.shapes else preset["shapes"]
  if a.breakdown:
    return print_breakdown(shapes, dtype, a.reps)
  if a.fused_output or a.switch:
    spec = a.switch or f"pallas_chunk.FUSED_OUTPUT={a.fused_output}"
    target, _, values = spec.partition("=")
    module, _, name = target.partition(".")
    settings = values.split(",")
    if not module or not name or not all(takes(name, s) for s in settings):
      p.error(f"--switch takes MODULE.NAME=a,b with settings from "
              f"{sorted(v for v in SETTINGS if takes(name, v))}, got {spec!r}")
    return print_switch(shapes, dtype, a.reps, module, name, settings)
  print("| B, T, H, D | method | fwd ms | fwd+bwd ms | fwd mem MiB | fwd+bwd mem MiB |"
        + (" fwd % of H200 floor | fwd+bwd % of H200 floor |" if on_gpu else ""))
  print("|---|---|---|---|---|---|" + ("---|---|" if on_gpu else ""))
  for shape in shapes:
    for method in methods:
      try:
        r = bench(shape, method, dtype, a.reps, skip_time=a.preset == "memory")
      except Exception as e:  # report and go on: one failing variant must not hide the others
        print(f"| {shape} | {method} | failed: {type(e).__name__}: {str(e)[:80]} | | | |", flush=True)
        continue
      ms = lambda key: f"{r[key]:.2f}" if key in r else "-"
      pct = ""
      if on_gpu:
        floors = floor_ms(shape, dtype.itemsize)
        pct = "".join(f" {100 * f / r[key]:.0f}% |" if key in r else " - |"
                      for f, key in zip(floors, ("fwd_ms", "fb_ms")))
      print(f"| {', '.join(map(str, shape))} | {method} | {ms('fwd_ms')} | {ms('fb_ms')} | "
            f"{r['fwd_mem'] / 2**20:.0f} | {r['fb_mem'] / 2**20:.0f} |{pct}", flush=True)


if __name__ == "__main__":
  main()
