"""XLA's memory estimate of the op's and one layer's forward + backward with the leaner backward settings, on any
backend (CPU included): `local_groups` (the chunk-local stage's backward over groups of chunks,
`intra_chunk.grouped`) and `chunk.OUTPUT_VJP` (the chunk scan and the output as one explicit reverse scan; method
chunk only), each row against the default (local_groups 1, OUTPUT_VJP off) of its method.

  python -m experiments.op_memory                       # op: B 4, T 2048, 2 heads x 128, bf16, C 64; layer: as
                                                        # experiments.layer_residuals (d_model 256, 4 x 1024)
  python -m experiments.op_memory --groups 1,4 --methods pallas --no-layer
  python -m experiments.op_memory --groups 1 --no-layer --switch intra_chunk.INVERSE_VJP --switch intra_chunk.LOCAL_VJP
  python -m experiments.op_memory --groups 1 --methods chunk --no-layer --decay channel --g-lower-bound -5   # KDA

--switch MODULE.NAME (repeatable) repeats the tables for every combination of those `gdn.ops` switches off and on
(each table's title names the setting); the "vs default" ratios are within a table.

Per row: bytes per token of the compiled gradient (arguments + outputs + temporaries, `compiled_bytes`), its
ratio to the method's default, and the median ms of --reps calls with its ratio (on a shared CPU a hint only).
"""

from __future__ import annotations

import argparse
import importlib
import itertools

import jax
import jax.numpy as jnp

from experiments.layer_residuals import layer_step
from gdn import ops
from gdn.bench.op_inputs import inputs
from gdn.bench.timing import compiled_bytes, timed
from gdn.ops import chunk


def op_step(method: str, local_groups: int, chunk_size: int, g_lower_bound=None):
  """loss(q, k, v, g, beta): a fixed weighting of the op's output (its gradient is the op's backward)."""

  def loss(q, k, v, g, beta):
    o = ops.gated_delta_rule(q, k, v, g, beta, method=method, chunk_size=chunk_size, local_groups=local_groups,
                             g_lower_bound=g_lower_bound)[0]
    return jnp.sum(o.astype(jnp.float32) * jnp.cos(jnp.arange(o.shape[-1], dtype=jnp.float32)))

  return loss


def measure(loss, args, argnums, reps: int) -> tuple:
  """(XLA's estimate in bytes, median ms) of jit(grad(loss)) on args; OUTPUT_VJP as set now (read at tracing)."""
  compiled = jax.jit(jax.grad(loss, argnums=argnums)).lower(*args).compile()
  return compiled_bytes(compiled), timed(compiled, args, reps)


def settings(methods, groups):
  """(method, local_groups, OUTPUT_VJP) rows: every group count, and for chunk each again with OUTPUT_VJP."""
  return [(m, G, vjp) for m in methods for vjp in ((False, True) if m == "chunk" else (False,)) for G in groups]


def table(title, rows, tokens):
  print(f"\n{title}\n")
  print("| method | OUTPUT_VJP | local_groups | XLA:CPU estimate, bytes/token | vs default | CPU ms | vs default |")
  print("|---|---|---:|---:|---:|---:|---:|")
  base = {}
  for (m, G, vjp), (b, ms) in rows:
    b0, ms0 = base.setdefault(m, (b, ms))  # each method's first row is its default
    on = "on" if vjp else "off"
    print(f"| {m} | {on} | {G} | {b / tokens:,.0f} | {b / b0:.2f}x | {ms:.1f} | {ms / ms0:.2f}x |", flush=True)


def run_rows(rows, make, args, argnums, reps):
  out = []
  for m, G, vjp in rows:
    chunk.OUTPUT_VJP = vjp
    try:
      out.append(((m, G, vjp), measure(make(m, G), args, argnums, reps)))
    finally:
      chunk.OUTPUT_VJP = False
  return out


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--shape", default="4,2048,2,128", help="the op's B,T,H,D (H = HV, K = V = D)")
  p.add_argument("--chunk-size", type=int, default=64)
  p.add_argument("--methods", default="chunk,pallas")
  p.add_argument("--groups", default="1,2,4,8", help="comma-separated local_groups")
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--no-layer", action="store_true", help="skip the layer table")
  p.add_argument("--d-model", type=int, default=256)
  p.add_argument("--tokens", type=int, default=4096, help="the layer's tokens a batch (B = tokens // length)")
  p.add_argument("--length", type=int, default=1024, help="the layer's T")
  p.add_argument("--switch", action="append", default=[], metavar="MODULE.NAME",
                 help="a gdn.ops module switch to run off and on (repeatable: every combination)")
  p.add_argument("--decay", choices=("head", "channel"), default="head",
                 help="the op's g: per head (Gated DeltaNet) or per key channel (KDA); the layer table keeps its own")
  p.add_argument("--g-lower-bound", type=float, metavar="LB",
                 help="the op's g_lower_bound (with --decay channel: the bounded chunk-local form)")
  return p.parse_args(argv)


def switch_settings(names):
  """[(label, {(module, attribute): value})] for every combination of the switches off and on; one unlabelled
  setting that changes nothing without switches."""
  targets = []
  for name in names:
    module, _, attr = name.partition(".")
    mod = importlib.import_module(f"gdn.ops.{module}")
    if not attr or not hasattr(mod, attr):
      raise SystemExit(f"--switch: gdn.ops.{module} has no setting {attr!r}")
    targets.append((name, mod, attr))
  combos = []
  for values in itertools.product((False, True), repeat=len(targets)):
    label = ", ".join(f"{n} {'on' if v else 'off'}" for (n, _, _), v in zip(targets, values))
    combos.append((label, {(mod, attr): v for (_, mod, attr), v in zip(targets, values)}))
  return combos


def main(argv=None):
  a = parse_args(argv)
  for label, switches in switch_settings(a.switch):
    before = {key: getattr(*key) for key in switches}
    for (mod, attr), value in switches.items():
      setattr(mod, attr, value)
    try:
      tables(a, f"; {label}" if label else "")
    finally:
      for (mod, attr), value in before.items():
        setattr(mod, attr, value)


def tables(a, suffix: str) -> None:
  B, T, H, D = map(int, a.shape.split(","))
  rows = settings(a.methods.split(","), [int(g) for g in a.groups.split(",")])
  args, _ = inputs((B, T, H, D), jnp.bfloat16, a.decay, jnp.float32 if a.decay == "channel" else None)
  make = lambda m, G: op_step(m, G, a.chunk_size, a.g_lower_bound)
  bound = "" if a.g_lower_bound is None else f", g_lower_bound {a.g_lower_bound:g}"
  table(f"# the op alone, fwd+bwd (gradient w.r.t. q, k, v, g, beta): B {B}, T {T}, {H} heads x {D}, bf16, "
        f"{a.decay} decay{bound}, chunk {a.chunk_size}; jax {jax.__version__}, {jax.default_backend()}{suffix}",
        run_rows(rows, make, args, (0, 1, 2, 3, 4), a.reps), B * T)
  if a.no_layer:
    return
  x = jax.random.normal(jax.random.key(1), (a.tokens // a.length, a.length, a.d_model), jnp.bfloat16)
  steps = {}

  def make_layer(m, G):
    loss, params = layer_step(a.d_model, H, D, m, "none", jnp.bfloat16, local_groups=G)
    steps["params"] = params
    return lambda x, params: loss(params, x)

  layer_rows = []
  for row in rows:  # the layer's parameters come with its loss: one row at a time
    loss = make_layer(row[0], row[1])
    layer_rows += run_rows([row], lambda m, G: loss, (x, steps["params"]), (0, 1), a.reps)
  table(f"# one gated_deltanet layer, fwd+bwd (gradient w.r.t. parameters and input): d_model {a.d_model}, "
        f"{H} heads x {D}, {a.tokens // a.length} x {a.length} tokens, bf16 activations, float32 parameters, "
        f"chunk 64, remat none{suffix}", layer_rows, a.tokens)


if __name__ == "__main__":
  main()
