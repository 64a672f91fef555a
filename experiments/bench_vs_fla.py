"""gdn's `gated_delta_rule(method="pallas")` against fla's Triton kernel in one process, on the same inputs.

Per shape (B, T, H, D with H = HV heads and K = V = D, or B, T, H, K, V: the 340M model's heads are
8,4096,6,256,512) both sides get the same q, k (unit rows), v, g (log-decays in
[log 0.9, 0]), beta (in (0, 1)) and output cotangent: drawn once in NumPy (`gdn.bench.op_inputs.inputs`), rounded
to their dtypes in JAX and copied bit for bit to PyTorch. Two variants:

  gdn  per-head decay g [B, T, H], per-head beta [B, T, H]: fla's `chunk_gated_delta_rule` (Gated DeltaNet).
  kda  per-key-channel decay g [B, T, H, K], per-head beta [B, T, H]: fla's `chunk_kda` (Kimi Delta Attention)
       with its fused extras off (use_gate_in_kernel, use_beta_sigmoid_in_kernel, use_qk_l2norm_in_kernel all
       False, the defaults): g is then the log-decay itself, beta the write strength, and chunk_kda computes the
       recurrence of its `naive_recurrent_kda`, which is gdn's op exactly (S <- Diag(exp g_t) S;
       S <- S + k_t (beta_t (v_t - S^T k_t))^T; o_t = S^T (scale q_t)). scale = K ** -0.5 on both sides.
       --fla-safe-gate lets fla assume gates in [-5, 0) (true of these inputs) for its faster intra-chunk
       kernel; fla's KimiDeltaAttention layer leaves it off by default, and so does this script.
       --gdn-g-lower-bound -5 is gdn's counterpart (`gated_delta_rule(..., g_lower_bound=-5)`: the chunk-local
       pair products as matmuls through 16-step sub-chunks); give both to compare the two bounded forms.

Order per shape: fla's forward and forward+backward run once (Triton compiles and autotunes), then gdn's (XLA
compiles), and only then is anything timed, both sides with the same clock: the median wall time of --reps calls
after one untimed call, each call followed by a device sync (`gdn.bench.timing.timed`, as bench_ops times gdn).
The forward is the output alone (fla's under torch.no_grad); forward+backward is the gradient of <o, do> with
respect to q, k, v, g and beta (torch.autograd.grad, jax.vjp). fla's `triton.testing.do_bench` medians (CUDA
events, L2 flushed between calls: bench_fla's clock) are printed beside. Between shapes the inputs are dropped
and PyTorch's cache emptied. rel err: max |o_fla - o_gdn| / max |o_gdn| (grad: the largest such ratio over the
five gradients). The goal of the project's issue: gdn / fla at most 0.5 forward and 0.8 forward+backward.

  python -m experiments.bench_vs_fla --variant gdn              # the five H200 shapes; needs CUDA, torch, fla
  python -m experiments.bench_vs_fla --variant kda
  python -m experiments.bench_vs_fla --variant kda --shapes 1,8192,96,128 4,4096,64,128
  python -m experiments.bench_vs_fla --gdn-only --shapes 1,64,1,16 --reps 1   # CPU smoke: gdn's columns only
  python -m experiments.bench_vs_fla --variant kda --switch intra_chunk.SEGSUM_MATMUL=off,primal

--switch MODULE.NAME=a,b prints the table once per setting of the module switch `gdn.ops.<MODULE>.<NAME>` (read
by the op at trace time; "off", "on", "auto" for False, True, None, and "primal" and "vjp" for SEGSUM_MATMUL),
gdn's side traced with it set and the setting restored after; fla is timed again beside each, so every table's
ratios come from one clock.

Without torch, fla or CUDA (or with --gdn-only) fla is skipped, its cells say "-", and gdn runs alone (on CPU in
Pallas' interpreter, which times nothing useful). fla 0.6.0 refuses its gated backward on Hopper with Triton <
3.7.1 (a numerics guard); for timing only this script sets `fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1 = True`,
and the header says so. JAX is told not to preallocate GPU memory (XLA_PYTHON_CLIENT_PREALLOCATE=false, unless
set already) so that both frameworks' allocators share the card.

--profile N adds, per shape, where each side's forward+backward spends its device time, from a profiler trace of 5
calls (`gdn.bench.profile`): fla's N largest kernels (torch.profiler, in this process), gdn's N largest kernels
and its time per named stage. gdn's trace is taken in a child process, this script again with `--gdn-only
--shapes <the shape> --profile N` and a hidden --profile-json PATH, to which the child writes its profile: a
process has one CUPTI subscriber, which torch.profiler keeps once it has traced fla. On a GPU the child runs with
XLA's command buffers off (`--xla_gpu_enable_command_buffer=` appended to XLA_FLAGS), so that its trace names each
kernel's HLO op and stage, and gdn's table says so: its kernel times come from a run without CUDA graphs, while
the timing table's come from this process, with them. A child that fails leaves a line with its exit code and
the end of its stderr in place of gdn's table.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before JAX's GPU client starts

import argparse  # noqa: E402
import gc  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments.cli import SETTINGS, add_autotune_cache, takes  # noqa: E402
from gdn.bench import autotune_cache  # noqa: E402
from gdn.bench.op_fns import make_fn, rel_err, vjp_of  # noqa: E402
from gdn.bench.op_inputs import PRESETS, inputs  # noqa: E402
from gdn.bench.timing import timed  # noqa: E402

# variant: the shape of g, and fla's function (module, name)
VARIANTS = {
    "gdn": dict(g_kind="head", fla=("fla.ops.gated_delta_rule", "chunk_gated_delta_rule")),
    "kda": dict(g_kind="channel", fla=("fla.ops.kda", "chunk_kda")),
}


def variant_inputs(variant: str, shape, dtype, g_dtype):
  """[q, k, v, g, beta] as JAX arrays (g per head for "gdn", per key channel for "kda") and the output's
  cotangent do [B, T, H, V] in dtype."""
  args, rng = inputs(shape, dtype, VARIANTS[variant]["g_kind"], g_dtype)
  do = jnp.asarray(rng.normal(size=args[2].shape), dtype)
  return args, do


def fla_kwargs(variant: str, K: int, safe_gate: bool = False) -> dict:
  """The keyword arguments that make fla's kernel compute gdn's recurrence on these inputs: g the log-decay as
  given (no gate activation in the kernel), beta as given (no sigmoid), q and k as given (no L2 norm), scale
  K ** -0.5, no initial or final state."""
  kw = dict(scale=K**-0.5, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
            use_beta_sigmoid_in_kernel=False)
  if variant == "kda":
    kw.update(use_gate_in_kernel=False, safe_gate=safe_gate, lower_bound=-5.0 if safe_gate else None)
  elif safe_gate:
    raise ValueError("safe_gate is chunk_kda's (--variant kda)")
  return kw


def to_torch(x, device="cpu", requires_grad=False):
  """A JAX array as a PyTorch tensor of the same dtype and values, bit for bit (through a float32 NumPy copy:
  bfloat16 widens to float32 exactly)."""
  import torch

  t = torch.from_numpy(np.array(x, np.float32)).to(device=device, dtype=getattr(torch, jnp.dtype(x.dtype).name))
  return t.requires_grad_() if requires_grad else t


def fla_available(gdn_only: bool):
  """(torch, None) if fla can run here (torch with CUDA and fla importable), else (None, the reason)."""
  if gdn_only:
    return None, "--gdn-only"
  try:
    import torch
  except ImportError:
    return None, "no torch"
  if not torch.cuda.is_available():
    return None, "no CUDA for torch"
  try:
    import fla  # noqa: F401
  except ImportError as e:
    return None, f"fla not importable ({e})"
  return torch, None


def gdn_side(args, do, g_lower_bound=None, method="pallas"):
  """gdn's `method` (bench_ops' function), jitted: (forward call, forward+backward call, sync)."""
  f = make_fn(method, None, g_lower_bound)
  fwd, fb = jax.jit(f), jax.jit(vjp_of(f))
  return (lambda: fwd(*args)), (lambda: fb(do, *args)), jax.block_until_ready


def fla_side(variant, args, do, kw, device="cuda"):
  """fla's kernel on copies of the same arrays on `device`: (forward call, forward+backward call, sync)."""
  import importlib

  import torch

  fn = getattr(importlib.import_module(VARIANTS[variant]["fla"][0]), VARIANTS[variant]["fla"][1])
  leaves = [to_torch(x, device, requires_grad=True) for x in args]
  dot = to_torch(do, device)
  sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else lambda: None

  def fwd():
    with torch.no_grad():
      return fn(*leaves, **kw)[0]

  def fwd_bwd():
    return torch.autograd.grad(fn(*leaves, **kw)[0], leaves, dot)

  return fwd, fwd_bwd, lambda _: sync()


def profiles(sides, args, do, steps: int, names=("gdn", "fla"), make=lambda: make_fn("pallas", None)) -> dict:
  """Per side in `names`, where the forward+backward call's device time goes (gdn.bench.profile): gdn's per kernel
  and per named stage, fla's per kernel, both traced in this process."""
  from gdn.bench.profile import jax_kernel_times, torch_kernel_times

  out = {}
  for name, side in sides.items():
    if name not in names:
      continue
    step = lambda side=side: side[2](side[1]())
    if name == "gdn":
      hlo = jax.jit(vjp_of(make())).lower(do, *args).compile().as_text()  # gdn's function, as timed
      out[name] = jax_kernel_times(step, steps, hlo)
    else:
      out[name] = torch_kernel_times(step, steps)
  return out


def measure(variant, shape, dtype, g_dtype, reps, torch=None, safe_gate=False, profile=(), g_lower_bound=None,
            method="pallas") -> dict:
  """One row: ms of each side (fla's only with torch given), fla's do_bench ms, and the rel errs; with the sides
  named in `profile`, their profiles (row["profiles"]). A side that fails to build or run is left out (its error
  in row["<side>_error"]) and the other still timed."""
  args, do = variant_inputs(variant, shape, dtype, g_dtype)
  builders = {"gdn": lambda: gdn_side(args, do, g_lower_bound, method)}
  if torch is not None:  # fla first: its autotuning, then XLA's compile
    builders = {"fla": lambda: fla_side(variant, args, do, fla_kwargs(variant, shape[3], safe_gate)), **builders}
  sides, outs, row = {}, {}, {}
  for name, build in builders.items():  # warm up both before anything is timed
    try:
      side = build()
      outs[name] = (side[0](), side[1]())
      side[2](outs[name])
      sides[name] = side
    except Exception as e:  # report and go on: one failing side must not hide the other
      row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:160]}"
  for key, i in (("fwd", 0), ("fb", 1)):
    for name, side in sides.items():
      row[f"{name}_{key}"] = timed(side[i], [], reps, side[2])
  if "fla" in sides:
    import triton

    row.update(fla_fwd_do_bench=triton.testing.do_bench(sides["fla"][0], return_mode="median"),
               fla_fb_do_bench=triton.testing.do_bench(sides["fla"][1], return_mode="median"))
  if profile:
    row["profiles"] = profiles(sides, args, do, steps=5, names=profile,
                               make=lambda: make_fn(method, None, g_lower_bound))
  if len(outs) == 2:
    host = lambda t: t.detach().float().cpu().numpy()
    (o_fla, g_fla), (o_gdn, g_gdn) = outs["fla"], outs["gdn"]
    row["rel_err"] = rel_err(host(o_fla), o_gdn)
    row["grad_rel_err"] = max(rel_err(host(a), b) for a, b in zip(g_fla, g_gdn))
  del outs, sides, builders, args, do
  free(torch)
  return row


def free(torch=None):
  """Drops what the last shape left (JAX arrays without references, PyTorch's cached blocks)."""
  gc.collect()
  if torch is not None:
    torch.cuda.empty_cache()


def gdn_profile_in_child(a, shape, switch_arg=None) -> dict:
  """gdn's profile at `shape` (a profiles() dict, or {"error": ...}), traced in a child process: this script with
  gdn alone (gdn.bench.profile.jax_profile_in_child), with `switch_arg` (MODULE.NAME=setting) as its --switch."""
  from gdn.bench.profile import jax_profile_in_child

  argv = ["--gdn-only", "--variant", a.variant, "--shapes", ",".join(map(str, shape)), "--dtype", a.dtype,
          "--g-dtype", a.g_dtype, "--reps", "1", "--profile", str(a.profile)]
  argv += ["--gdn-g-lower-bound", str(a.gdn_g_lower_bound)] if a.gdn_g_lower_bound is not None else []
  argv += ["--gdn-method", a.gdn_method]
  argv += ["--switch", switch_arg] if switch_arg else []
  return jax_profile_in_child("experiments.bench_vs_fla", argv)[0]


def parse_shapes(p, texts):
  """--shapes' B,T,H,D or B,T,H,K,V texts as tuples; a bad one is refused naming the flag."""
  from gdn.bench.op_inputs import dims

  shapes = []
  for text in texts:
    try:
      shape = tuple(int(x) for x in text.split(","))
      dims(shape)
    except ValueError:
      p.error(f"--shapes takes B,T,H,D or B,T,H,K,V (positive integers), got {text!r}")
    shapes.append(shape)
  return shapes


def main(argv=None) -> list:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--variant", choices=sorted(VARIANTS), default="gdn")
  p.add_argument("--preset", choices=sorted(PRESETS), default="h200")
  p.add_argument("--shapes", nargs="*", help="override the preset's shapes, each as B,T,H,D (K = V = D) or B,T,H,K,V")
  p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="q, k, v, beta, o")
  p.add_argument("--g-dtype", choices=["float32", "bfloat16"], default="float32",
                 help="g's dtype on both sides (float32: what fla's layers and bench_fla pass)")
  p.add_argument("--reps", type=int, default=10)
  p.add_argument("--gdn-only", action="store_true", help="skip fla (also skipped without torch, CUDA or fla)")
  p.add_argument("--fla-safe-gate", action="store_true",
                 help="kda: chunk_kda(safe_gate=True, lower_bound=-5), its kernel for gates in [-5, 0)")
  p.add_argument("--gdn-method", default="pallas", choices=["pallas", "chunk", "associative"],
                 help="gdn's method (pallas, the fastest on a GPU; chunk to time the XLA form on a CPU)")
  p.add_argument("--gdn-g-lower-bound", type=float, metavar="LB",
                 help="kda: gdn's g_lower_bound=LB (e.g. -5), its bounded chunk-local factorisation for gates in "
                      "[LB, 0) (these inputs' gates are in [log 0.9, 0]); with --fla-safe-gate both sides assume it")
  p.add_argument("--profile", type=int, default=0, metavar="N",
                 help="after each shape, the N kernels of each side's forward+backward that take the most device "
                      "time (and gdn's time per named stage), from a profiler trace of 5 calls (gdn's in a child "
                      "process)")
  p.add_argument("--switch", metavar="MODULE.NAME=off,on",
                 help="one table per setting of the gdn.ops module switch, e.g. intra_chunk.SEGSUM_MATMUL=off,on")
  p.add_argument("--hlo", metavar="DIR",
                 help="write the optimised HLO of gdn's forward+backward at each shape (the program that --profile "
                      "traces, whose fusion names its kernel table shows) to DIR/gdn_<variant>_B_T_H_D.hlo.txt.gz "
                      "(with --switch, one per setting: ..._B_T_H_D_NAME_setting.hlo.txt.gz)")
  add_autotune_cache(p)
  p.add_argument("--profile-json", metavar="PATH", help=argparse.SUPPRESS)  # a profiling child's output
  a = p.parse_args(argv)
  autotune_cache.use(None if a.gdn_only else a.autotune_cache)
  if a.gdn_g_lower_bound is not None and a.variant != "kda":
    p.error("--gdn-g-lower-bound is for --variant kda")
  if a.fla_safe_gate and a.variant != "kda":
    p.error("--fla-safe-gate is for --variant kda")
  switch = parse_switch(p, a.switch)
  shapes = parse_shapes(p, a.shapes) if a.shapes else PRESETS[a.preset]["shapes"]
  torch, why = fla_available(a.gdn_only)
  head = (f"# {a.variant}: gdn method='{a.gdn_method}' vs fla {VARIANTS[a.variant]['fla'][1]}, one process, "
          "same inputs; "
          f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
  if torch is not None:
    import fla
    import fla.ops.common.chunk_o as chunk_o
    import triton

    patched = not getattr(chunk_o, "TRITON_ABOVE_3_7_1", True)
    chunk_o.TRITON_ABOVE_3_7_1 = True
    head += (f", torch {torch.__version__}, triton {triton.__version__}, fla {getattr(fla, '__version__', '?')}"
             + (" (TRITON_ABOVE_3_7_1 forced for fla's backward, timing only)" if patched else "")
             + (", fla safe_gate=True lower_bound=-5" if a.fla_safe_gate else ""))
  if a.gdn_g_lower_bound is not None:
    head += f", gdn g_lower_bound={a.gdn_g_lower_bound:g}"
  else:
    head += f"; fla skipped: {why}"
  print(head + f"; {a.dtype} q, k, v, beta, {a.g_dtype} g; chunk 64; median of {a.reps} synced calls "
        "(do_bench: fla's triton.testing.do_bench median)")
  rows = []
  if switch is None:
    rows += table(a, shapes, torch)
  else:
    module, name, settings = switch
    for setting in settings:
      print(f"\n## gdn with gdn.ops.{module.__name__.rsplit('.', 1)[-1]}.{name}={setting}")
      before = getattr(module, name)
      setattr(module, name, SETTINGS[setting])
      try:
        rows += [dict(r, switch=setting) for r in table(a, shapes, torch, switch_arg=f"{a.switch.partition('=')[0]}={setting}")]
        for shape in shapes if a.hlo else ():  # each setting's program, its file named by the setting
          print(f"hlo: {write_hlo(a.hlo, a.variant, shape, a.dtype, a.g_dtype, tag=f'{name}_{setting}')}")
      finally:
        setattr(module, name, before)
  if a.hlo and switch is None:
    for shape in shapes:
      print(f"hlo: {write_hlo(a.hlo, a.variant, shape, a.dtype, a.g_dtype)}")
  if a.profile_json:
    from gdn.bench.profile import write_profiles
    write_profiles(a.profile_json, [r["profiles"]["gdn"] for r in rows if "gdn" in r.get("profiles", {})])
  if a.profile:
    from gdn.bench.profile import format_times
    for r in rows:
      for side, prof in r.get("profiles", {}).items():
        shape = ", ".join(map(str, r["shape"])) + (f"; {r['switch']}" if "switch" in r else "")
        print("\n" + format_times(prof, a.profile, title=f"{side}, ({shape}), fwd+bwd: "))
  return rows


def write_hlo(where: str, variant: str, shape, dtype, g_dtype, tag: str = "") -> str:
  """The optimised HLO text of gdn's forward+backward (the program `profiles` traces) at one shape, gzipped
  under `where` (with --switch, one file per setting, `tag` in its name); its path."""
  import gzip

  args, do = variant_inputs(variant, shape, dtype, g_dtype)
  text = jax.jit(vjp_of(make_fn("pallas", None))).lower(do, *args).compile().as_text()
  os.makedirs(where, exist_ok=True)
  path = os.path.join(where, f"gdn_{variant}_{'_'.join(map(str, shape))}{'_' + tag if tag else ''}.hlo.txt.gz")
  with gzip.open(path, "wt") as f:
    f.write(text)
  return path


def parse_switch(p, spec):
  """(module, name, settings) of --switch MODULE.NAME=a,b (a module of gdn.ops), or None without it."""
  if spec is None:
    return None
  import importlib

  target, _, values = spec.partition("=")
  module, _, name = target.partition(".")
  settings = values.split(",")
  if not module or not name or not values or not all(takes(name, s) for s in settings):
    p.error(f"--switch takes MODULE.NAME=a,b with settings from "
            f"{sorted(v for v in SETTINGS if takes(name, v))}, got {spec!r}")
  try:
    mod = importlib.import_module(f"gdn.ops.{module}")
  except ImportError:
    p.error(f"--switch: no module gdn.ops.{module}")
  if not hasattr(mod, name):
    p.error(f"--switch: gdn.ops.{module} has no setting {name}")
  return mod, name, settings


def table(a, shapes, torch, switch_arg=None) -> list:
  """The table's rows, one per shape (printed as they come), with the switch as the caller set it."""
  columns = "B, T, H, K, V" if any(len(s) == 5 for s in shapes) else "B, T, H, D"
  print(f"| {columns} | fla fwd ms | gdn fwd ms | gdn/fla fwd | fla fwd+bwd ms | gdn fwd+bwd ms | gdn/fla fwd+bwd | "
        "rel err o | rel err grads | fla do_bench fwd / fwd+bwd ms |")
  print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
  # the sides traced here: gdn's only in a profiling child (--profile-json), which runs it alone
  here = () if not a.profile else ("gdn",) if a.profile_json else ("fla",)
  rows = []
  for shape in shapes:
    name = ", ".join(map(str, shape))
    try:
      r = measure(a.variant, shape, jnp.dtype(a.dtype), jnp.dtype(a.g_dtype), a.reps, torch, a.fla_safe_gate,
                  here, a.gdn_g_lower_bound, a.gdn_method)
    except Exception as e:  # report and go on: one failing shape must not hide the others
      print(f"| {name} | failed: {type(e).__name__}: {str(e)[:160]} |", flush=True)
      free(torch)
      continue
    for side in ("fla", "gdn"):
      if f"{side}_error" in r:
        print(f"  {name}: {side} failed: {r[side + '_error']}", flush=True)
    ms = lambda k: f"{r[k]:.3f}" if k in r else "-"
    ratio = lambda k: f"{r['gdn_' + k] / r['fla_' + k]:.2f}x" if f"fla_{k}" in r and f"gdn_{k}" in r else "-"
    err = lambda k: f"{r[k]:.1e}" if k in r else "-"
    bench = f"{r['fla_fwd_do_bench']:.3f} / {r['fla_fb_do_bench']:.3f}" if "fla_fwd_do_bench" in r else "-"
    print(f"| {name} | {ms('fla_fwd')} | {ms('gdn_fwd')} | {ratio('fwd')} | {ms('fla_fb')} | {ms('gdn_fb')} | "
          f"{ratio('fb')} | {err('rel_err')} | {err('grad_rel_err')} | {bench} |", flush=True)
    if a.profile and not a.profile_json and "gdn_fb" in r:
      r.setdefault("profiles", {})["gdn"] = gdn_profile_in_child(a, shape, switch_arg)
    rows.append(dict(shape=shape, **r))
  return rows


if __name__ == "__main__":
  main()
