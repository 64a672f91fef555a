"""Layer training throughput: one Gated DeltaNet layer against one softmax attention layer, vs sequence length.

Both layers have the same d_model, heads and head dim: `RecurrentMixer` with the "gated_deltanet" preset
(`--method`, default "auto") and causal `Attention` (RoPE, GQA with `--kv-heads`; `jax.nn.dot_product_attention`
through cuDNN where `Attention` picks it: 16-bit inputs on a GPU). Each row is one sequence length T at a fixed
number of tokens per batch, B = tokens // T, so the work outside the mixing (the projections) is the same on
every row and what changes is how each layer's mixing scales with T: attention's grows with T, GDN's does not.

Measured: forward+backward, the gradient of the sum of the layer's outputs with respect to its parameters and
its input [B, T, d_model], as one jitted program; median ms of `reps` runs after one warm-up, each blocked on
until the gradients are ready. tokens/s = B T / time; attention/GDN is the ratio of the times (> 1: GDN is
faster); the crossover is the first T at which GDN is faster. mem is XLA's buffer assignment for the compiled
program (arguments + outputs + temporaries - aliased). A row whose program does not fit in device memory (at
compile or at run time) reads "OOM"; other failures are reported in the cell, and the other rows still run.
Parameters are float32; --dtype is the activations' dtype, as in the models.

  python -m experiments.bench_layers --preset cpu
  python -m experiments.bench_layers --preset h200
  python -m experiments.bench_layers --preset h200 --kv-heads 4 --method pallas --lengths 4096,65536
"""

from __future__ import annotations

import argparse
import gc

import jax
import jax.numpy as jnp
from flax import nnx

from experiments.cli import apply_preset
from gdn.bench.timing import compiled_bytes, timed
from gdn.config import AttentionConfig, recurrent_preset
from gdn.ops import checks
from gdn.layers.attention import Attention
from gdn.layers.recurrent import RecurrentMixer
from gdn.ops.api import pick_method
from gdn.ops.checks import Dims

PRESETS = {
    "cpu": dict(d_model=128, heads=2, head_dim=64, tokens=4096, lengths=[256, 512, 1024, 2048], dtype="float32",
                reps=5),
    # A ~1.3B model's layer width. 65536 tokens per batch keeps B >= 1 up to T = 64K.
    "h200": dict(d_model=2048, heads=16, head_dim=128, tokens=65536,
                 lengths=[512, 1024, 2048, 4096, 8192, 16384, 32768, 65536], dtype="bfloat16", reps=5),
}


def build(kind: str, a):
  """One layer as (graphdef, params, rest); its call returns y [B, T, D]."""
  rngs, dtype = nnx.Rngs(0), jnp.dtype(a.dtype)
  if kind == "gdn":
    cfg = recurrent_preset("gated_deltanet", num_heads=a.heads, head_dim=a.head_dim, method=a.method)
    layer = RecurrentMixer(cfg, a.d_model, dtype=dtype, rngs=rngs)
  else:
    cfg = AttentionConfig(num_heads=a.heads, num_kv_heads=a.kv_heads, head_dim=a.head_dim,
                          implementation=a.attention_impl)
    layer = Attention(cfg, a.d_model, dtype=dtype, rngs=rngs)
  return nnx.split(layer, nnx.Param, ...)


def fwd_bwd(graphdef):
  """(params, rest, x) -> gradients of sum(y) w.r.t. params and x."""

  def loss(params, rest, x):
    y, _ = nnx.merge(graphdef, params, rest)(x)
    # Summed in float32: a bfloat16 sum over B T D elements would round away most of it.
    return jnp.sum(y.astype(jnp.float32))

  return jax.jit(jax.grad(loss, argnums=(0, 2)))


def is_oom(e: Exception) -> bool:
  text = str(e)
  return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def bench(fn, params, rest, x, reps: int) -> dict:
  """ms and mem of one layer at one shape, or the failure: "OOM" when it does not fit."""
  try:
    compiled = fn.lower(params, rest, x).compile()
    row = dict(mem=compiled_bytes(compiled))
    row["ms"] = timed(compiled, (params, rest, x), reps)
    return row
  except Exception as e:  # report and go on: a length that does not fit must not hide the others
    if is_oom(e):
      return dict(error="OOM")
    first_line = (str(e).splitlines() or [""])[0]
    return dict(error=f"failed: {type(e).__name__}: {first_line[:60]}")


def gdn_method(a, B: int, T: int) -> str:
  """The op method the GDN layer runs at [B, T]: what "auto" resolves to, or the method asked for."""
  if a.method != "auto":
    return a.method
  return pick_method(Dims(B, T, a.heads, a.heads, a.head_dim, a.head_dim, "head", "head"),
                     recurrent_preset("gated_deltanet").chunk_size)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
  for name in ("d-model", "heads", "head-dim", "tokens", "reps"):
    p.add_argument(f"--{name}", type=int, help="override the preset")
  p.add_argument("--kv-heads", type=int, help="attention's key/value heads (GQA); default: --heads")
  p.add_argument("--dtype", choices=["float32", "bfloat16"], help="override the preset")
  p.add_argument("--lengths", help="comma-separated sequence lengths T (override the preset)")
  p.add_argument("--method", default="auto", choices=checks.METHODS,
                 help="the GDN layer's op method")
  p.add_argument("--attention-impl", default="auto", choices=["auto", "xla", "cudnn"],
                 help="jax.nn.dot_product_attention's implementation (auto: cuDNN for 16-bit on a GPU)")
  a = p.parse_args(argv)
  apply_preset(a, PRESETS[a.preset], "lengths")
  too_long = [T for T in a.lengths if T > a.tokens]
  if too_long:
    p.error(f"every length must be <= --tokens={a.tokens} (B = tokens // T), got {too_long}")
  return a


def main(argv=None) -> list:
  """Prints the table; returns its rows as dicts."""
  a = parse_args(argv)
  layers = {kind: build(kind, a) for kind in ("gdn", "attention")}
  fns = {kind: fwd_bwd(graphdef) for kind, (graphdef, _, _) in layers.items()}
  att_impl = nnx.merge(*layers["attention"]).implementation(jnp.dtype(a.dtype), False) or "xla"

  dev = jax.devices()[0]
  kv = a.kv_heads or a.heads
  print(f"# layer fwd+bwd, {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}: d_model "
        f"{a.d_model}, {a.heads} heads x {a.head_dim} (attention: {kv} kv heads, {att_impl}), {a.dtype} "
        f"activations, float32 parameters, {a.tokens} tokens per batch; GDN method {a.method}; median of {a.reps}")
  print()
  print("| T | B | GDN method | GDN fwd+bwd ms | attention fwd+bwd ms | GDN tokens/s | attention tokens/s | "
        "attention/GDN | GDN mem MiB | attention mem MiB |")
  print("|---:|---:|:---:|---:|---:|---:|---:|---:|---:|---:|")
  rows, crossover = [], None
  for T in a.lengths:
    B = a.tokens // T
    x = jax.random.normal(jax.random.key(1), (B, T, a.d_model), jnp.dtype(a.dtype))
    row = dict(T=T, B=B, method=gdn_method(a, B, T))
    for kind, (_, params, rest) in layers.items():
      row[kind] = bench(fns[kind], params, rest, x, a.reps)
      gc.collect()
    del x
    g, att = row["gdn"], row["attention"]
    ms = lambda r: f"{r['ms']:.2f}" if "ms" in r else r["error"]
    tps = lambda r: f"{B * T / (r['ms'] / 1e3):,.0f}" if "ms" in r else "-"
    mib = lambda r: f"{r['mem'] / 2**20:.0f}" if r.get("mem") is not None else "-"
    ratio = "-"
    if "ms" in g and "ms" in att:
      ratio = f"{att['ms'] / g['ms']:.2f}x"
      if crossover is None and g["ms"] < att["ms"]:
        crossover = T
    print(f"| {T} | {B} | {row['method']} | {ms(g)} | {ms(att)} | {tps(g)} | {tps(att)} | {ratio} | {mib(g)} | "
          f"{mib(att)} |", flush=True)
    rows.append(row)
  print()
  if crossover is None:
    print("Crossover: none (GDN is not faster at any T measured)")
  else:
    print(f"Crossover: GDN is faster from T = {crossover} (the first T measured where it is)")
  return rows


if __name__ == "__main__":
  main()
