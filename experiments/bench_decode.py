"""Decode benchmark: time per generated token and cache memory vs context length, for Gated DeltaNet ("R"),
attention with a KV cache ("A") and the 3:1 hybrid ("RRRA"), all of the same width and depth.

Prints two markdown tables: median ms/token with the ratios A/R and RRRA/R per context, then memory per model
and context (`gdn.memory.cache_bytes` of the cache, the live cache's nbytes, XLA's temporaries of the compiled
decode loop and, where the backend reports it, the device's bytes in use and peak).

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
  python -m experiments.bench_decode --preset h200 --layers 24 --contexts 1024,131072
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from experiments.cli import apply_preset
from gdn.bench.timing import device_memory_stats
from gdn.config import AttentionConfig, ModelConfig, RecurrentConfig
from gdn.layers import KVCache
from gdn.memory import GiB, MiB, cache_bytes
from gdn.model import LanguageModel

PRESETS = {
    "cpu": dict(d_model=256, layers=4, heads=4, head_dim=64, vocab=256, dtype="float32",
                contexts=[256, 512, 1024, 2048, 4096], steps=32, reps=5),
    # d_model 2048, 16 heads x 128 as a ~1.3B model, 12 of its layers (three RRRA periods). The largest contexts
    # are skipped (or reported as failed) where the attention cache does not fit.
    "h200": dict(d_model=2048, layers=12, heads=16, head_dim=128, vocab=32000, dtype="bfloat16",
                 contexts=[1024, 4096, 16384, 65536, 131072, 262144, 524288], steps=32, reps=5),
}
PATTERNS = ("R", "A", "RRRA")
BLOCK = 1024  # the K/V fill tiles a random block of this many slots


def model_config(a, pattern: str) -> ModelConfig:
  return ModelConfig(vocab_size=a.vocab, d_model=a.d_model, num_layers=a.layers, pattern=pattern, dtype=a.dtype,
                     recurrent=RecurrentConfig(num_heads=a.heads, head_dim=a.head_dim),
                     attention=AttentionConfig(num_heads=a.heads, head_dim=a.head_dim))


def _positions(c: KVCache, context: int) -> KVCache:
  """Slot positions after `context` tokens: slot s holds the last position p < context with p % L == s."""
  L = c.kpos.shape[0]
  s = jnp.arange(L, dtype=jnp.int32)
  p = s + L * ((context - 1 - s) // L)
  return c._replace(kpos=jnp.where(s < context, p, -1), pos=jnp.asarray(context, jnp.int32))


def rewind(cache: tuple, context: int) -> tuple:
  return tuple(_positions(c, context) if isinstance(c, KVCache) else c for c in cache)


def fill(cache: tuple, key, context: int) -> tuple:
  """Random K and V in every attention slot, positions as after `context` tokens; recurrent caches unchanged."""
  out = []
  for c in cache:
    if isinstance(c, KVCache):
      B, L, G, E = c.k.shape
      n = min(L, BLOCK)
      key, kk, kv = jax.random.split(key, 3)
      tile = lambda r: jnp.tile(jax.random.normal(r, (B, n, G, E), c.k.dtype), (1, -(-L // n), 1, 1))[:, :L]
      c = _positions(c._replace(k=tile(kk), v=tile(kv)), context)
    out.append(c)
  return tuple(out)


def nbytes(tree) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(tree))


def bench(model, context: int, a) -> dict:
  graphdef, state = nnx.split(model)
  steps = a.steps

  def decode(state, cache, tok):
    m = nnx.merge(graphdef, state)

    def body(_, carry):
      tok, cache = carry
      logits, cache = m.decode_step(tok[:, None], cache)
      return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache

    return jax.lax.fori_loop(0, steps, body, (tok, cache))

  cache = model.init_cache(a.batch, context + steps)
  row = dict(formula=cache_bytes(model.cfg, a.batch, context + steps).total, live=nbytes(cache))
  cache = jax.jit(fill, static_argnums=2, donate_argnums=0)(cache, jax.random.key(1), context)
  tok = jnp.zeros((a.batch,), jnp.int32)
  compiled = jax.jit(decode, donate_argnums=1).lower(state, cache, tok).compile()
  m = compiled.memory_analysis()
  row["temp"] = m.temp_size_in_bytes if m is not None else None
  rewind_ = jax.jit(rewind, static_argnums=1, donate_argnums=0)
  tok, cache = jax.block_until_ready(compiled(state, cache, tok))  # warm-up
  times = []
  for _ in range(a.reps):
    cache = jax.block_until_ready(rewind_(cache, context))
    t0 = time.perf_counter()
    tok, cache = jax.block_until_ready(compiled(state, cache, tok))
    times.append(time.perf_counter() - t0)
  row["ms"] = 1e3 * statistics.median(times) / steps
  stats = device_memory_stats()
  row["in_use"], row["peak"] = stats.get("bytes_in_use"), stats.get("peak_bytes_in_use")
  del cache
  return row


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
  p.add_argument("--contexts", help="comma-separated context lengths (override the preset)")
  p.add_argument("--patterns", default=",".join(PATTERNS), help="comma-separated layer patterns; the first is the "
                 "denominator of the ratios")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--mem-fraction", type=float, default=0.8,
                 help="skip a context when the cache would exceed this fraction of the device's memory limit")
  a = p.parse_args(argv)
  apply_preset(a, PRESETS[a.preset], "contexts")
  patterns = [s.strip() for s in a.patterns.split(",") if s.strip()]

  limit = device_memory_stats().get("bytes_limit")
  results = {}
  # Patterns in order of growing cache, contexts ascending: each row's device peak then is its own, unless it
  # stays below an earlier row's (marked "<=").
  for pattern in sorted(patterns, key=lambda q: q.count("A") / len(q)):
    cfg = model_config(a, pattern)
    model = LanguageModel(cfg, rngs=nnx.Rngs(0))
    for n in a.contexts:
      need = cache_bytes(cfg, a.batch, n + a.steps).total
      if limit is not None and need > a.mem_fraction * limit:
        results[pattern, n] = dict(error=f"skipped: cache {fmt_bytes(need)}")
        continue
      try:
        results[pattern, n] = bench(model, n, a)
      except Exception as e:  # report and go on: an out-of-memory context must not hide the others
        results[pattern, n] = dict(error=f"failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
      gc.collect()
    del model
    gc.collect()

  dev = jax.devices()[0]
  base = patterns[0]
  print(f"# decode, {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}: d_model {a.d_model}, "
        f"{a.layers} layers, {a.heads} heads x {a.head_dim}, vocab {a.vocab}, {a.dtype}, batch {a.batch}; "
        f"{a.steps} decode steps per run, median of {a.reps}")
  print()
  ratio_heads = [f"{q}/{base}" for q in patterns[1:]]
  print("| context | " + " | ".join(f"{q} ms/token" for q in patterns) + " | " + " | ".join(ratio_heads) + " |")
  print("|---" * (len(patterns) + len(ratio_heads) + 1) + "|")
  for n in a.contexts:
    rs = [results[q, n] for q in patterns]
    ms = [f"{r['ms']:.3f}" if "ms" in r else r["error"] for r in rs]
    ratios = [f"{r['ms'] / rs[0]['ms']:.2f}x" if "ms" in r and "ms" in rs[0] else "-" for r in rs[1:]]
    print(f"| {n} | " + " | ".join(ms) + " | " + " | ".join(ratios) + " |")
  print()
  print("| model | context | cache (gdn.memory) | live cache nbytes | XLA temp | device in use | device peak |")
  print("|---|---|---|---|---|---|---|")
  last_peak = 0
  for q in sorted(patterns, key=lambda q: q.count("A") / len(q)):
    for n in a.contexts:
      r = results[q, n]
      if "ms" not in r:
        print(f"| {q} | {n} | {r['error']} | | | | |")
        continue
      peak = fmt_bytes(r["peak"])
      if r["peak"] is not None:
        peak = ("<= " if r["peak"] <= last_peak else "") + peak
        last_peak = max(last_peak, r["peak"])
      print(f"| {q} | {n} | {fmt_bytes(r['formula'])} | {fmt_bytes(r['live'])} | {fmt_bytes(r['temp'])} | "
            f"{fmt_bytes(r['in_use'])} | {peak} |")


if __name__ == "__main__":
  main()
