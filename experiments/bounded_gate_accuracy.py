"""How close `gated_delta_rule(..., g_lower_bound=LB)` (KDA's bounded gate: the chunk-local pair products as matmuls
through 16-step sub-chunks) comes to the float64 recurrence, beside the exact form, per output and gradient.

  python -m experiments.bounded_gate_accuracy            # CPU, under a minute

Rows: float32 inputs with the log-decays g all at the bound (-5: every sub-chunk spans -80, the largest factors),
all at -1, and drawn (a third at the bound, a third within 1e-3 of 0, the rest uniform in [-5, 0]); bfloat16
inputs (the drawn g) with the dots' operands in float32 and in bfloat16 (`intra_chunk.BOUNDED_LOWP_DOTS`).
Columns: relative error (Frobenius norm of the difference over the reference's) of the output o and of each
gradient of <o, do> + <S_T, dS> (random cotangents), `method="chunk"`, chunk 64, (B, T, H, K, V) = (2, 80, 2, 16, 16)
with per-head beta and an initial state.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from gdn.ops import gated_delta_rule, intra_chunk

NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def make(g_case: str, shape=(2, 80, 2, 16, 16), seed=0) -> dict:
  B, T, H, K, V = shape
  rng = np.random.default_rng(seed)
  k = rng.normal(size=(B, T, H, K))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  lb = intra_chunk.MIN_G_LOWER_BOUND
  if g_case == "drawn":
    pick = rng.integers(0, 3, (B, T, H, K))
    g = np.where(pick == 0, lb, np.where(pick == 1, -rng.uniform(0, 1e-3, pick.shape), rng.uniform(lb, 0, pick.shape)))
  else:
    g = np.full((B, T, H, K), float(g_case))
  return dict(q=rng.normal(size=(B, T, H, K)), k=k, v=rng.normal(size=(B, T, H, V)), g=g,
              beta=rng.uniform(0, 1, (B, T, H)), initial_state=0.5 * rng.normal(size=(B, H, K, V)),
              do=rng.normal(size=(B, T, H, V)), dS=rng.normal(size=(B, H, K, V)))


def forward_and_grads(x: dict, dtype, method: str, bound) -> dict:
  """o and the gradients, as float64 NumPy arrays."""
  cast = {n: jnp.asarray(x[n], jnp.float32 if n == "initial_state" and dtype != jnp.float64 else dtype) for n in NAMES}

  def f(args):
    o, S = gated_delta_rule(args["q"], args["k"], args["v"], args["g"], args["beta"],
                            initial_state=args["initial_state"], method=method, chunk_size=64, g_lower_bound=bound)
    return o, S

  (o, S), vjp = jax.vjp(f, cast)
  (grads,) = vjp((jnp.asarray(x["do"], o.dtype), jnp.asarray(x["dS"], S.dtype)))
  return {"o": np.asarray(o, np.float64), **{f"d{n}": np.asarray(grads[n], np.float64) for n in NAMES}}


def rel(a, b) -> float:
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def main(argv=None) -> list:
  argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
  lb = intra_chunk.MIN_G_LOWER_BOUND
  rows = [("float32, g = -5 everywhere", "-5", jnp.float32, False),
          ("float32, g = -1 everywhere", "-1", jnp.float32, False),
          ("float32, g drawn in [-5, 0]", "drawn", jnp.float32, False),
          ("bfloat16, g drawn, float32 dots", "drawn", jnp.bfloat16, False),
          ("bfloat16, g drawn, bfloat16 dots", "drawn", jnp.bfloat16, True)]
  cols = ["o"] + [f"d{n}" for n in NAMES]
  print(f"# jax {jax.__version__}, {jax.devices()[0].device_kind}; relative error against the float64 recurrence")
  print("| inputs | form | " + " | ".join(cols) + " |")
  print("|---|---|" + "---:|" * len(cols))
  out, before = [], intra_chunk.BOUNDED_LOWP_DOTS
  for label, g_case, dtype, lowp in rows:
    x = make(g_case)
    if dtype == jnp.bfloat16:  # the oracle sees the values the bfloat16 inputs hold
      x = {n: np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64) if n in ("q", "k", "v", "g", "beta") else a
           for n, a in x.items()}
    with jax.enable_x64(True):
      want = forward_and_grads(x, jnp.float64, "recurrent", None)
    for form, bound in (("exact", None), (f"g_lower_bound={lb:g}", lb)):
      if lowp and bound is None:
        continue
      intra_chunk.BOUNDED_LOWP_DOTS = lowp
      try:
        got = forward_and_grads(x, dtype, "chunk", bound)
      finally:
        intra_chunk.BOUNDED_LOWP_DOTS = before
      errs = {c: rel(got[c], want[c]) for c in cols}
      out.append(dict(inputs=label, form=form, **errs))
      print(f"| {label} | {form} | " + " | ".join(f"{errs[c]:.1e}" for c in cols) + " |", flush=True)
  return out


if __name__ == "__main__":
  main()
