"""Decode benchmark: time per generated token and cache memory vs context length, for Gated DeltaNet ("R"),
attention with a KV cache ("A") and the 3:1 hybrid ("RRRA"), all of the same width and depth.

Prints markdown tables: per pattern, decode path, batch and context the median ms per step (one token for each
of the batch's rows), tokens/s (batch x 1000 / ms), the floor of a step, ms / floor and the operations one step
of the compiled loop runs (`gdn.bench.timing.ops_per_iteration`: about its kernel launches); then per path and
batch ms/token with the ratios A/R and RRRA/R per context; then memory per model and context
(`gdn.memory.cache_bytes` of the cache, the live cache's nbytes, XLA's temporaries of the compiled decode loop
and, where the backend reports it, the device's bytes in use and peak).

Decode paths (`--paths`): "plain" calls `decode_step` on the model as built (float32 parameters, cast to the
compute dtype inside the step, one matmul per projection); "lean" calls it on `gdn.model.for_decoding(model)`
(weights stored in the compute dtype, the projections of one input fused into one matmul); "lean_unrolled" on
`for_decoding(model, unroll=True)`, the same unrolled where the model is scanned; "lean_xla" and "lean_kernel" are
"lean" with `gdn.ops.pallas_decode.DECODE_KERNEL` forced off and on (a recurrent layer's decode step after its
fused projection as XLA's fusions, or as one Pallas kernel; "lean" takes the switch's default: the kernel from
batch `pallas_decode.MIN_BATCH`); "lean_split" is "lean_kernel" with `pallas_decode.SPLIT_V` on (the kernel's grid
over blocks of value channels, the output norm after it in XLA). All give the same logits.
`--scan-layers` builds the models with `scan_layers` (one layer body in a `lax.scan`).

The floor (`gdn.bench.roofline.decode_floor_ms`): every weight read once per step (the lean model's parameter
bytes) plus the states and caches moved, at `--bandwidth-gbs`: recurrent states and conv windows read and
written, attention K/V read for the context's positions and written for the new one.

Method. For each model and context n: `cache = model.init_cache(B, n + steps)`, then the cache is filled to n
tokens directly, with no prefill: every attention cache's K and V get random values (a random block tiled over
the slots) and its slot positions and token counter are written as if n tokens had been seen; recurrent caches
keep their initial state (a step of the recurrence costs the same whatever S holds, and S does not grow). A
real prefill of 128K tokens through attention would dominate the run time and is not what is measured here.
Then one jitted program runs `steps` calls of `model.decode_step` in a `lax.fori_loop` (greedy: each token is
the argmax of the previous logits), with the cache donated; it is timed with `block_until_ready` `reps` times,
the positions rewound to n before each run (untimed), and the median divided by `steps` is reported. Note that
`gdn.layers.Attention` attends over all max_len = n + steps slots of its cache under a mask, so its cost
follows the cache's capacity.

  python -m experiments.bench_decode --preset cpu
  python -m experiments.bench_decode --preset h200
  python -m experiments.bench_decode --preset h200 --patterns R --paths plain,lean --batches 1,8,64 \
      --contexts 1024,65536
  python -m experiments.bench_decode --preset h200 --layers 24 --contexts 1024,131072
  python -m experiments.bench_decode --preset h200 --patterns R --paths lean_xla,lean_kernel,lean_split \
      --batches 1,8,64 --contexts 1024
  python -m experiments.bench_decode --preset h200 --patterns R --paths lean_xla --contexts 1024 \
      --mlp-hidden 5632 --xla-option xla_gpu_enable_triton_gemm=false
  python -m experiments.bench_decode --preset h200 --patterns R --paths lean_xla --contexts 1024 --mlp-multiple 1

`--mlp-hidden` sets the SwiGLU width (the preset's d_model 2048 gives 5464, which XLA's split-K matmul pads to a
multiple of 64 in every step; fla rounds its width up to a multiple of 256: 5632); `--mlp-multiple M` keeps the
model's width and widens the lean model's MLPs with zero weights to a multiple of M (`for_decoding(...,
mlp_multiple=M)`, whose default is 256; 1 keeps the width: the same logits; the floor counts the zeros, which are
read). `--xla-option KEY=VALUE`
(repeatable) compiles the decode loop with that XLA option (`jax.stages.Lowered.compile(compiler_options=...)`;
values true/false, integers or strings), to time XLA's choices for batch-1 matmuls.

`--switch MODULE.NAME=a,b` (repeatable) times every path under each value of a module switch under gdn, as rows
labelled "path NAME=value": e.g. `layers.fused.PAD_SINGLE_ROW=off,auto`, the lean model's one-row matmuls as
they are or on two rows (auto: on a GPU), or `ops.pallas_matvec.MATVEC_KERNEL=off,auto`, its matmuls of up to 16
rows as XLA's or through the Pallas kernel.

`--profile` traces one more run of every timed row's loop (`gdn.bench.profile.jax_kernel_times`) and prints,
per row, the device time per token that the kernels took against the timed ms/token (the rest is the device
idle between kernels: launches and the loop's control), split into matmuls (kernels whose name or HLO op reads
as a GEMM: cuBLAS, XLA's Triton GEMM fusions) and the rest, then the `--profile-top` kernels by time per token.
On a GPU, run it with `XLA_FLAGS=--xla_gpu_enable_command_buffer=` so that every kernel is traced under its
own HLO op rather than inside a CUDA graph (the table says whether that was so).

  XLA_FLAGS=--xla_gpu_enable_command_buffer= python -m experiments.bench_decode --preset h200 --patterns R \
      --paths lean_xla,lean_split --batches 1 --contexts 1024 --profile
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import re
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from experiments.cli import apply_preset, apply_setting, setting_label, switch_settings
from gdn.bench.profile import format_times, jax_kernel_times
from gdn.bench.roofline import H200_HBM_TBPS, decode_floor_ms
from gdn.bench.timing import device_memory_stats, ops_per_iteration
from gdn.config import AttentionConfig, ModelConfig, RecurrentConfig
from gdn.layers import KVCache
from gdn.memory import GiB, MiB, cache_bytes
from gdn.model import LanguageModel, for_decoding
from gdn.ops import pallas_decode

PRESETS = {
    "cpu": dict(d_model=256, layers=4, heads=4, head_dim=64, vocab=256, dtype="float32",
                contexts=[256, 512, 1024, 2048, 4096], steps=32, reps=5),
    # d_model 2048, 16 heads x 128 as a ~1.3B model, 12 of its layers (three RRRA periods). The largest contexts
    # are skipped (or reported as failed) where the attention cache does not fit.
    "h200": dict(d_model=2048, layers=12, heads=16, head_dim=128, vocab=32000, dtype="bfloat16",
                 contexts=[1024, 4096, 16384, 65536, 131072, 262144, 524288], steps=32, reps=5),
}
PATTERNS = ("R", "A", "RRRA")
PATHS = ("plain", "lean", "lean_unrolled", "lean_xla", "lean_kernel", "lean_split")
# The paths that force `pallas_decode.DECODE_KERNEL` and `pallas_decode.SPLIT_V` (the kernel's grid over value blocks).
DECODE_KERNEL = dict(lean_xla=False, lean_kernel=True, lean_split=True)
SPLIT_V = dict(lean_kernel=False, lean_split=True)
BLOCK = 1024  # the K/V fill tiles a random block of this many slots
# A kernel whose name or HLO op reads as a matmul: cuBLAS/cuBLASLt (gemm, xmma, nvjet, cutlass kernels; HLO
# custom-calls named cublas...), XLA's Triton GEMM fusions (gemm_fusion..., triton_gemm...), a CPU's dot thunks.
MATMUL = re.compile(r"gemm|cublas|xmma|nvjet|cutlass|matmul|\bdot|dot[._]|dot$", re.IGNORECASE)


def is_matmul(kernel: str, hlo_op: str) -> bool:
  return bool(MATMUL.search(kernel) or MATMUL.search(hlo_op))


def per_token(prof: dict, steps: int) -> dict:
  """A profile of one run of the decode loop (`steps` tokens) scaled to one token, with its device time split
  into matmuls and the rest: us and launches per token."""
  kernels = [(us / steps, n / steps, name, op, stage) for us, n, name, op, stage in prof["kernels"]]
  out = dict(prof, steps=1, total_us=prof["total_us"] / steps, kernels=kernels,
             traced=f"one traced run of the loop's {steps} steps, divided by {steps}",
             stages=[(us / steps, s) for us, s in prof["stages"]])
  mm = [k for k in kernels if is_matmul(k[2], k[3])]
  out["matmul_us"], out["matmul_launches"] = sum(k[0] for k in mm), sum(k[1] for k in mm)
  out["launches"] = sum(k[1] for k in kernels)
  return out


def model_config(a, pattern: str) -> ModelConfig:
  return ModelConfig(vocab_size=a.vocab, d_model=a.d_model, num_layers=a.layers, pattern=pattern, dtype=a.dtype,
                     mlp_hidden=a.mlp_hidden,
                     recurrent=RecurrentConfig(num_heads=a.heads, head_dim=a.head_dim),
                     attention=AttentionConfig(num_heads=a.heads, head_dim=a.head_dim),
                     scan_layers=getattr(a, "scan_layers", False))


def _positions(c: KVCache, context: int) -> KVCache:
  """Slot positions after `context` tokens: slot s holds the last position p < context with p % L == s. A
  scanned group's cache carries a leading layer axis, which every layer shares."""
  L = c.kpos.shape[-1]
  s = jnp.arange(L, dtype=jnp.int32)
  p = s + L * ((context - 1 - s) // L)
  return c._replace(kpos=jnp.broadcast_to(jnp.where(s < context, p, -1), c.kpos.shape),
                    pos=jnp.full(c.pos.shape, context, jnp.int32))


def _kv_caches(fn, cache: tuple) -> tuple:
  """fn applied to every KVCache of a model's cache (a scanned group's too), the recurrent caches unchanged."""
  is_kv = lambda c: isinstance(c, KVCache)
  return jax.tree.map(lambda c: fn(c) if is_kv(c) else c, cache, is_leaf=is_kv)


def rewind(cache: tuple, context: int) -> tuple:
  return _kv_caches(lambda c: _positions(c, context), cache)


def fill(cache: tuple, key, context: int) -> tuple:
  """Random K and V in every attention slot, positions as after `context` tokens; recurrent caches unchanged."""
  keys = iter(jax.random.split(key, 2 * len(jax.tree.leaves(cache))))

  def one(c):
    *lead, G, L, E = c.k.shape  # [..., B, G, L, E]
    n = min(L, BLOCK)
    tile = lambda r: jnp.tile(jax.random.normal(r, (*lead, G, n, E), c.k.dtype), (-(-L // n), 1))[..., :L, :]
    return _positions(c._replace(k=tile(next(keys)), v=tile(next(keys))), context)

  return _kv_caches(one, cache)


def nbytes(tree) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(tree))


def state_bytes(cache: tuple, context: int) -> int:
  """Bytes a decode step at `context` must move through the caches: recurrent states and conv windows read and
  written; attention K/V read for the context's positions and the new one, and written for the new one."""
  total = 0
  for c in jax.tree.leaves(cache, is_leaf=lambda x: hasattr(x, "_fields")):  # one RecurrentCache or KVCache each
    if isinstance(c, KVCache):
      L = c.kpos.shape[-1]
      total += (c.k.nbytes + c.v.nbytes) * (min(context + 1, L) + 1) // L
    else:
      total += 2 * nbytes(c)
  return total


@contextlib.contextmanager
def decode_kernel(path: str):
  """`pallas_decode.DECODE_KERNEL` and `SPLIT_V` as the path asks while its programs are traced, restored after."""
  before = pallas_decode.DECODE_KERNEL, pallas_decode.SPLIT_V
  pallas_decode.DECODE_KERNEL = DECODE_KERNEL.get(path, before[0])
  pallas_decode.SPLIT_V = SPLIT_V.get(path, before[1])
  try:
    yield
  finally:
    pallas_decode.DECODE_KERNEL, pallas_decode.SPLIT_V = before


def bench(model, context: int, batch: int, a, programs: dict) -> dict:
  """One row: the decode loop compiled for this cache's shapes (or taken from `programs`, where an earlier row
  had the same shapes: a recurrent model's cache does not depend on the context) and timed."""
  graphdef, state = nnx.split(model)
  steps = a.steps

  def decode(state, cache, tok):
    m = nnx.merge(graphdef, state)

    def body(_, carry):
      tok, cache = carry
      logits, cache = m.decode_step(tok[:, None], cache)
      return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache

    return jax.lax.fori_loop(0, steps, body, (tok, cache))

  cache = model.init_cache(batch, context + steps)
  row = dict(formula=cache_bytes(model.cfg, batch, context + steps).total, live=nbytes(cache),
             state_bytes=state_bytes(cache, context))
  cache = jax.jit(fill, static_argnums=2, donate_argnums=0)(cache, jax.random.key(1), context)
  tok = jnp.zeros((batch,), jnp.int32)
  key = (jax.tree.structure(cache), tuple((x.shape, x.dtype) for x in jax.tree.leaves(cache)))
  if key not in programs:
    programs[key] = jax.jit(decode, donate_argnums=1).lower(state, cache, tok).compile(
        compiler_options=a.compiler_options or None)
  compiled = programs[key]
  m = compiled.memory_analysis()
  row["temp"] = m.temp_size_in_bytes if m is not None else None
  row["ops"] = ops_per_iteration(compiled)
  rewind_ = jax.jit(rewind, static_argnums=1, donate_argnums=0)
  tok, cache = jax.block_until_ready(compiled(state, cache, tok))  # warm-up
  times = []
  for _ in range(a.reps):
    cache = jax.block_until_ready(rewind_(cache, context))
    t0 = time.perf_counter()
    tok, cache = jax.block_until_ready(compiled(state, cache, tok))
    times.append(time.perf_counter() - t0)
  row["ms"] = 1e3 * statistics.median(times) / steps
  if a.profile:
    cache = jax.block_until_ready(rewind_(cache, context))
    carry = [tok, cache]

    def run():
      carry[:] = jax.block_until_ready(compiled(state, carry[1], carry[0]))  # (tok, cache) back

    row["profile"] = per_token(jax_kernel_times(run, steps=1, hlo_text=compiled.as_text()), steps)
    tok, cache = carry
  row["floor"] = decode_floor_ms(a.weight_bytes, row["state_bytes"], a.bandwidth_gbs / 1e3)
  stats = device_memory_stats()
  row["in_use"], row["peak"] = stats.get("bytes_in_use"), stats.get("peak_bytes_in_use")
  del cache
  return row


def parse_xla_options(p, items: list) -> dict:
  """["KEY=VALUE", ...] as compile options: true/false as booleans, integers as ints, anything else a string."""
  out = {}
  for item in items:
    key, sep, value = item.partition("=")
    if not sep or not key:
      p.error(f"--xla-option must be KEY=VALUE, got {item!r}")
    low = value.lower()
    if low in ("true", "false"):
      out[key] = low == "true"
    else:
      try:
        out[key] = int(value)
      except ValueError:
        out[key] = value
  return out


def fmt_bytes(b) -> str:
  if b is None:
    return "-"
  return f"{b / GiB:.2f} GiB" if b >= GiB else f"{b / MiB:.2f} MiB"


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
  for name, kind in (("d-model", int), ("layers", int), ("heads", int), ("head-dim", int), ("vocab", int),
                     ("steps", int), ("reps", int)):
    p.add_argument(f"--{name}", type=kind, help="override the preset")
  p.add_argument("--dtype", choices=["float32", "bfloat16"], help="override the preset")
  p.add_argument("--mlp-hidden", type=int, help="the SwiGLU's width (default: from d_model, a multiple of 8)")
  p.add_argument("--mlp-multiple", type=int, default=256,
                 help="lean paths: the MLPs widened with zeros to a multiple of this (for_decoding's default "
                 "256; 1 keeps the width)")
  p.add_argument("--xla-option", action="append", default=[], metavar="KEY=VALUE",
                 help="an XLA compile option for the decode loop (repeatable)")
  p.add_argument("--contexts", help="comma-separated context lengths (override the preset)")
  p.add_argument("--patterns", default=",".join(PATTERNS), help="comma-separated layer patterns; the first is the "
                 "denominator of the ratios")
  p.add_argument("--batches", default="1", help="comma-separated batch sizes")
  p.add_argument("--paths", default="lean", help=f"comma-separated decode paths, of {', '.join(PATHS)}")
  p.add_argument("--scan-layers", action="store_true", help="stacked layers applied by one lax.scan")
  p.add_argument("--bandwidth-gbs", type=float, default=1e3 * H200_HBM_TBPS,
                 help="memory bandwidth of the floor, GB/s (default: the H200's)")
  p.add_argument("--switch", action="append", metavar="MODULE.NAME=a,b",
                 help="a module switch under gdn (values off, on, auto), e.g. layers.fused.PAD_SINGLE_ROW=off,auto: "
                 "every path timed under each value, as rows 'path NAME=value' (repeatable: every combination)")
  p.add_argument("--profile", action="store_true",
                 help="trace one more run of each timed row: device time per token by kernel (see above)")
  p.add_argument("--profile-top", type=int, default=25, help="kernels listed per profiled row")
  p.add_argument("--mem-fraction", type=float, default=0.8,
                 help="skip a context when the cache would exceed this fraction of the device's memory limit")
  a = p.parse_args(argv)
  apply_preset(a, PRESETS[a.preset], "contexts")
  a.compiler_options = parse_xla_options(p, a.xla_option)
  patterns = [s.strip() for s in a.patterns.split(",") if s.strip()]
  batches = [int(s) for s in a.batches.split(",") if s.strip()]
  base_paths = [s.strip() for s in a.paths.split(",") if s.strip()]
  if set(base_paths) - set(PATHS):
    p.error(f"--paths must be of {PATHS}, got {a.paths!r}")
  # Each path under each --switch setting: a row label "path" or "path SETTING", its path and its setting.
  settings = switch_settings(a.switch)
  for setting in settings:  # refuse a bad switch before anything compiles
    apply_setting(setting)()
  variants = {(path if setting == "-" else f"{path} {setting_label(setting)}"): (path, setting)
              for setting in settings for path in base_paths}
  paths = list(variants)

  limit = device_memory_stats().get("bytes_limit")
  results, weights = {}, {}
  # Patterns in order of growing cache, contexts ascending: each row's device peak then is its own, unless it
  # stays below an earlier row's (marked "<=").
  for pattern in sorted(patterns, key=lambda q: q.count("A") / len(q)):
    cfg = model_config(a, pattern)
    base = LanguageModel(cfg, rngs=nnx.Rngs(0))
    lean = for_decoding(base, mlp_multiple=a.mlp_multiple)
    # The floor reads each weight once in the compute dtype: the lean model's bytes, whichever path is timed.
    a.weight_bytes = weights[pattern] = nbytes(nnx.state(lean, nnx.Param))
    models = dict(plain=base, lean=lean, lean_xla=lean, lean_kernel=lean, lean_split=lean)
    if "lean_unrolled" in base_paths:
      models["lean_unrolled"] = for_decoding(base, unroll=True, mlp_multiple=a.mlp_multiple) if cfg.scan_layers \
          else lean
    for variant in paths:
      path, setting = variants[variant]
      restore = apply_setting(setting)
      programs = {}
      for batch in batches:
        for n in a.contexts:
          need = cache_bytes(cfg, batch, n + a.steps).total
          if limit is not None and need > a.mem_fraction * limit:
            results[pattern, variant, batch, n] = dict(error=f"skipped: cache {fmt_bytes(need)}")
            continue
          try:
            with decode_kernel(path):
              results[pattern, variant, batch, n] = bench(models[path], n, batch, a, programs)
          except Exception as e:  # report and go on: an out-of-memory context must not hide the others
            results[pattern, variant, batch, n] = dict(
                error=f"failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
          gc.collect()
      restore()
      del programs
    del base, lean, models
    gc.collect()

  dev = jax.devices()[0]
  base = patterns[0]
  print(f"# decode, {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}: d_model {a.d_model}, "
        f"{a.layers} layers{' (scan_layers)' if a.scan_layers else ''}, {a.heads} heads x {a.head_dim}, "
        f"vocab {a.vocab}, {a.dtype}{f', SwiGLU width {a.mlp_hidden}' if a.mlp_hidden else ''}"
        f"{f', lean MLPs widened to a multiple of {a.mlp_multiple}' if a.mlp_multiple != 1 else ''}"
        f"{''.join(f', {k}={v}' for k, v in a.compiler_options.items())}; {a.steps} decode steps per run, "
        f"median of {a.reps}; floor at "
        f"{a.bandwidth_gbs:.0f} GB/s; weights " + ", ".join(f"{q} {fmt_bytes(w)}" for q, w in weights.items()))
  print()

  def rows(order):
    """(batch, row head "| pattern | path | batch | context", result) of every timed row; a failed row printed."""
    for key in itertools.product(order, paths, batches, a.contexts):
      head, r = "| " + " | ".join(map(str, key)), results[key]
      if "ms" in r:
        yield key[2], head, r
      else:  # both tables have five columns after the head
        print(f"{head} | {r['error']} | | | | |")

  print("| pattern | path | batch | context | ms/token | tokens/s | floor ms | ms / floor | ops/step |")
  print("|---|---|---|---|---|---|---|---|---|")
  for batch, head, r in rows(patterns):
    print(f"{head} | {r['ms']:.3f} | {batch * 1e3 / r['ms']:.0f} | {r['floor']:.3f} | {r['ms'] / r['floor']:.2f}x | "
          f"{r['ops']} |")
  if len(patterns) > 1:
    for path in paths:
      for batch in batches:
        print()
        print(f"{path}, batch {batch}:")
        print()
        ratio_heads = [f"{q}/{base}" for q in patterns[1:]]
        print("| context | " + " | ".join(f"{q} ms/token" for q in patterns) + " | " + " | ".join(ratio_heads) + " |")
        print("|---" * (len(patterns) + len(ratio_heads) + 1) + "|")
        for n in a.contexts:
          rs = [results[q, path, batch, n] for q in patterns]
          ms = [f"{r['ms']:.3f}" if "ms" in r else r["error"] for r in rs]
          ratios = [f"{r['ms'] / rs[0]['ms']:.2f}x" if "ms" in r and "ms" in rs[0] else "-" for r in rs[1:]]
          print(f"| {n} | " + " | ".join(ms) + " | " + " | ".join(ratios) + " |")
  print()
  print("| model | path | batch | context | cache (gdn.memory) | live cache nbytes | XLA temp | device in use | "
        "device peak |")
  print("|---|---|---|---|---|---|---|---|---|")
  last_peak = 0
  for _, head, r in rows(sorted(patterns, key=lambda q: q.count("A") / len(q))):
    peak = fmt_bytes(r["peak"])
    if r["peak"] is not None:
      peak = ("<= " if r["peak"] <= last_peak else "") + peak
      last_peak = max(last_peak, r["peak"])
    print(f"{head} | {fmt_bytes(r['formula'])} | {fmt_bytes(r['live'])} | {fmt_bytes(r['temp'])} | "
          f"{fmt_bytes(r['in_use'])} | {peak} |")
  if a.profile:
    print_profiles([("| " + " | ".join(map(str, key)), results[key])
                    for key in itertools.product(patterns, paths, batches, a.contexts) if "ms" in results[key]],
                   a.profile_top)


def print_profiles(timed: list, top: int) -> None:
  """Per profiled row ((row head, result)): kernels' device time per token against the timed ms/token, matmuls
  and the rest, then its `top` kernels."""
  print()
  print("Device time per token by kind (the profiled run; idle = timed ms/token - kernels' time):")
  print()
  # Each row starts with its head "| pattern | path | batch | context", four cells.
  print("| pattern | path | batch | context | timed ms/token | kernels ms | matmuls ms (launches) | "
        "other ms (launches) | idle ms |")
  print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
  for head, r in timed:
    q = r["profile"]
    print(f"{head} | {r['ms']:.3f} | {q['total_us'] / 1e3:.3f} | {q['matmul_us'] / 1e3:.3f} "
          f"({q['matmul_launches']:.0f}) | {(q['total_us'] - q['matmul_us']) / 1e3:.3f} "
          f"({q['launches'] - q['matmul_launches']:.0f}) | {r['ms'] - q['total_us'] / 1e3:.3f} |")
  for head, r in timed:
    print()
    print(format_times(r["profile"], top=top, title=f"{head.removeprefix('| ')}: ", per="token"))


if __name__ == "__main__":
  main()
