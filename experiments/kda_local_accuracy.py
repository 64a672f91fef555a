"""How close the per-key-channel (KDA) chunk-local forms come to the float64 recurrence, per output and gradient:
the exact form by pairwise decays inside 16-step sub-chunks (`intra_chunk.CHANNEL_PAIR_DYADIC` off), the exact
form by dyadic anchors (on; its level dots' operands in float32 or, `intra_chunk.DYADIC_LOWP_DOTS`, in bfloat16),
and `gated_delta_rule(..., g_lower_bound=LB)` (KDA's bounded gate: matmuls through 16-step sub-chunks, their dots'
operands in float32 or, `intra_chunk.BOUNDED_LOWP_DOTS`, in bfloat16).

  python -m experiments.kda_local_accuracy            # CPU, about a minute
  python -m experiments.kda_local_accuracy --dtypes float32   # the float32 rows only

Rows: float32 inputs with the log-decays g all at the bound (-5: every sub-chunk spans -80, the bounded form's
largest factors), all at -1, drawn (a third at the bound, a third within 1e-3 of 0, the rest uniform in [-5, 0]),
and drawn ten times as strong (in [-50, 0], beyond any bound: the exact forms only); bfloat16 inputs (the drawn g).
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
  if g_case in ("drawn", "strong"):
    low = lb if g_case == "drawn" else 10 * lb
    pick = rng.integers(0, 3, (B, T, H, K))
    g = np.where(pick == 0, low, np.where(pick == 1, -rng.uniform(0, 1e-3, pick.shape),
                                          rng.uniform(low, 0, pick.shape)))
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

  @jax.jit  # one program a form (traced afresh, so each form's module switches hold)
  def run(args, do, dS):
    (o, S), vjp = jax.vjp(f, args)
    (grads,) = vjp((do.astype(o.dtype), dS.astype(S.dtype)))
    return o, grads

  o, grads = run(cast, jnp.asarray(x["do"], dtype), jnp.asarray(x["dS"], cast["initial_state"].dtype))
  return {"o": np.asarray(o, np.float64), **{f"d{n}": np.asarray(grads[n], np.float64) for n in NAMES}}


def rel(a, b) -> float:
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


# (label, g_lower_bound, module switches) of each form.
PAIRWISE = ("exact, pairwise decays", None, dict(CHANNEL_PAIR_DYADIC=False))
DYADIC = ("exact, dyadic anchors", None, dict(CHANNEL_PAIR_DYADIC=True, DYADIC_LOWP_DOTS=False))
DYADIC_LOWP = ("exact, dyadic anchors, bfloat16 dots", None, dict(CHANNEL_PAIR_DYADIC=True, DYADIC_LOWP_DOTS=True))
BOUNDED = ("g_lower_bound=-5", intra_chunk.MIN_G_LOWER_BOUND, dict(BOUNDED_LOWP_DOTS=False))
BOUNDED_LOWP = ("g_lower_bound=-5, bfloat16 dots", intra_chunk.MIN_G_LOWER_BOUND, dict(BOUNDED_LOWP_DOTS=True))


def run_form(x: dict, dtype, form) -> dict:
  _, bound, switches = form
  before = {n: getattr(intra_chunk, n) for n in switches}
  try:
    for n, v in switches.items():
      setattr(intra_chunk, n, v)
    return forward_and_grads(x, dtype, "chunk", bound)
  finally:
    for n, v in before.items():
      setattr(intra_chunk, n, v)


def main(argv=None) -> list:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--dtypes", default="float32,bfloat16", help="the input dtypes whose rows run (comma-separated)")
  a = p.parse_args(argv)
  dtypes = a.dtypes.split(",")
  if not set(dtypes) <= {"float32", "bfloat16"}:
    p.error(f"--dtypes takes float32 and/or bfloat16, got {a.dtypes!r}")
  exact, every = (PAIRWISE, DYADIC), (PAIRWISE, DYADIC, BOUNDED)
  rows = [("float32, g = -5 everywhere", "-5", jnp.float32, every),
          ("float32, g = -1 everywhere", "-1", jnp.float32, every),
          ("float32, g drawn in [-5, 0]", "drawn", jnp.float32, every),
          ("float32, g drawn in [-50, 0]", "strong", jnp.float32, exact),
          ("bfloat16, g drawn in [-5, 0]", "drawn", jnp.bfloat16, every + (DYADIC_LOWP, BOUNDED_LOWP))]
  cols = ["o"] + [f"d{n}" for n in NAMES]
  print(f"# jax {jax.__version__}, {jax.devices()[0].device_kind}; relative error against the float64 recurrence")
  print("| inputs | form | " + " | ".join(cols) + " |")
  print("|---|---|" + "---:|" * len(cols))
  out = []
  for label, g_case, dtype, forms in [r for r in rows if jnp.dtype(r[2]).name in dtypes]:
    x = make(g_case)
    if dtype == jnp.bfloat16:  # the oracle sees the values the bfloat16 inputs hold
      x = {n: np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64) if n in ("q", "k", "v", "g", "beta") else a
           for n, a in x.items()}
    with jax.enable_x64(True):
      want = forward_and_grads(x, jnp.float64, "recurrent", None)
    for form in forms:
      got = run_form(x, dtype, form)
      errs = {c: rel(got[c], want[c]) for c in cols}
      out.append(dict(inputs=label, form=form[0], **errs))
      print(f"| {label} | {form[0]} | " + " | ".join(f"{errs[c]:.1e}" for c in cols) + " |", flush=True)
  return out


if __name__ == "__main__":
  main()
