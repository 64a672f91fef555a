"""What one Gated DeltaNet layer's backward keeps, per `RecurrentConfig.remat`, on any backend (CPU included).

For each remat setting: the bytes per token of the residuals `jax.vjp` keeps for the backward of the layer's
training step (the gradient of sum(output) with respect to parameters and input, as
`experiments/bench_layer_fla.py`), the largest of them grouped by shape and origin, and XLA's memory estimate of
the compiled step (arguments + outputs + temporaries; --no-compile skips it).

  python -m experiments.layer_residuals                      # d_model 256, 2 heads x 128, 4 x 1024 tokens, bf16
  python -m experiments.layer_residuals --dtype float32 --method pallas --length 256 --tokens 512
  python -m experiments.layer_residuals --remats none --switch ops.intra_chunk.LOWP_SOLVE=off,on   # a row each

At the default shape every per-token quantity is 1/8 of the H200 shape of bench_layer_fla (d_model 2048,
16 heads x 128: the same K and chunk size, 8x the heads and d_model), so bytes per token x 8 x 65536 are that
shape's bytes.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from flax import nnx

from experiments.cli import apply_setting, setting_label, switch_settings
from gdn.bench.residuals import residual_bytes, saved_residuals, summarize
from gdn.bench.timing import compiled_bytes
from gdn.config import MIXER_REMATS, recurrent_preset
from gdn.layers.recurrent import RecurrentMixer


def layer_step(d_model: int, heads: int, head_dim: int, method: str, remat: str, dtype, local_groups: int = 1):
  """(loss(params, x), params) of one gated_deltanet RecurrentMixer with float32 parameters: the sum of its
  output (the training step of experiments/bench_layer_fla.py too)."""
  cfg = recurrent_preset("gated_deltanet", num_heads=heads, head_dim=head_dim, method=method, remat=remat,
                         local_groups=local_groups)
  graphdef, params, rest = nnx.split(RecurrentMixer(cfg, d_model, dtype=dtype, rngs=nnx.Rngs(0)), nnx.Param, ...)

  def loss(params, x):
    y, _ = nnx.merge(graphdef, params, rest)(x)
    return jnp.sum(y.astype(jnp.float32))  # summed in float32: a bfloat16 sum would round most of it away

  return loss, params


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--d-model", type=int, default=256)
  p.add_argument("--heads", type=int, default=2)
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--tokens", type=int, default=4096, help="tokens a batch (B = tokens // length)")
  p.add_argument("--length", type=int, default=1024, help="sequence length T")
  p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
  p.add_argument("--method", default="chunk")
  p.add_argument("--remats", default=",".join(MIXER_REMATS), help="comma-separated RecurrentConfig.remat values")
  p.add_argument("--top", type=int, default=6, help="largest residual groups listed per setting")
  p.add_argument("--no-compile", action="store_true", help="skip XLA's estimate (no compilation)")
  p.add_argument("--switch", action="append", metavar="MODULE.NAME=off,on",
                 help="a module switch under gdn (e.g. ops.intra_chunk.LOWP_SOLVE=off,on): one row per setting; "
                      "repeated, one row per combination")
  return p.parse_args(argv)


def main(argv=None) -> list:
  a = parse_args(argv)
  dtype = jnp.dtype(a.dtype)
  x = jax.random.normal(jax.random.key(1), (a.tokens // a.length, a.length, a.d_model), dtype)
  print(f"# one gated_deltanet layer, fwd+bwd: d_model {a.d_model}, {a.heads} heads x {a.head_dim}, {a.tokens} tokens "
        f"a batch, T {a.length}, {a.dtype} activations, float32 parameters, method {a.method}")
  rows = []
  for setting in switch_settings(a.switch):
    restore = apply_setting(setting)
    try:
      for remat in a.remats.split(","):
        loss, params = layer_step(a.d_model, a.heads, a.head_dim, a.method, remat, dtype)
        res = saved_residuals(loss, params, x)
        est = (None if a.no_compile else
               compiled_bytes(jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile()))
        rows.append(dict(remat=remat, setting=setting, kept=residual_bytes(res) / a.tokens,
                         estimate=None if est is None else est / a.tokens, top=summarize(res, a.top)))
    finally:
      restore()
  label = lambda r: r["remat"] + (f", {setting_label(r['setting'])}" if a.switch else "")
  print("| remat | kept for the backward, bytes/token | XLA estimate of the step, bytes/token |")
  print("|---|---:|---:|")
  for r in rows:
    est = "-" if r["estimate"] is None else f"{r['estimate']:,.0f}"
    print(f"| {label(r)} | {r['kept']:,.0f} | {est} |")
  for r in rows:
    print(f"\nremat={label(r)}: largest kept (bytes/token, count, shape, dtype, made by)")
    for b, n, shape, dt, what in r["top"]:
      print(f"  {b / a.tokens:8,.0f}  {n} x {shape} {dt}  {what}")
  return rows


if __name__ == "__main__":
  main()
