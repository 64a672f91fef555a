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

"pallas" is in the GPU presets only: on CPU its kernels run in Pallas' interpreter, which times nothing useful.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from gdn.ops import checks, pallas_chunk
from gdn.ops.api import _IMPLS
from gdn.ops.chunk import chunk, finish, initial, prepare

PRESETS = {
    "cpu": dict(shapes=[(1, 512, 4, 64), (1, 2048, 4, 64), (1, 8192, 4, 64)],
                methods=["recurrent", "plain_port", "chunk", "associative"]),
    "h200": dict(shapes=[(4, 2048, 16, 128), (2, 16384, 16, 128), (1, 8192, 96, 128), (4, 4096, 64, 128),
                         (8, 1024, 8, 64)],
                 methods=["plain_port", "chunk", "associative", "pallas"]),
    "memory": dict(shapes=[(1, 65536, 4, 64)], methods=["chunk", "chunk_remat", "associative", "pallas"]),
    "long": dict(shapes=[(1, 65536, 2, 64), (1, 262144, 1, 64)], methods=["chunk", "associative", "pallas"]),
}


# The rates an H200 reaches (not measured by this script): an 8192^3 bf16 matrix product at about 790 TFLOP/s
# and a device-to-device copy at about 4.3 TB/s (bytes read plus written), both through PyTorch on the card.
H200_PEAKS = dict(tflops=790.0, tbps=4.3)


def roofline(shape, io_bytes: int = 2, chunk_size: int = 64) -> dict:
  """The floor of the chunkwise gated delta rule on (B, T, H, D), K = V = D, per-head g and beta.

  FLOP per chunk of C tokens and head: K K^T, Q K^T and W = T (beta K) at 2 C^2 K each; U = T (beta V) and
  the intra-chunk P U at 2 C^2 V each; W S, Q S and the state update K^T U at 2 C K V each; the triangular
  inverse 2 C^3 / 3. Forward + backward counts 3x the forward's FLOP (the backward's products are twice the
  forward's). Bytes: the forward reads q, k, v and writes o; forward + backward also reads q, k, v, o's
  cotangent and writes dq, dk, dv (11 tensors of B T H D in io_bytes; g, beta and the states not counted).
  """
  B, T, H, D = shape
  C, K, V = chunk_size, D, D
  per_chunk = 2 * C * C * (3 * K + 2 * V) + 6 * C * K * V + 2 * C**3 / 3
  fwd_flop = per_chunk * (-(-T // C)) * B * H
  tensor = B * T * H * D * io_bytes
  return dict(fwd_flop=fwd_flop, fwd_bytes=4 * tensor, fb_flop=3 * fwd_flop, fb_bytes=11 * tensor)


def floor_ms(shape, io_bytes=2, tflops=H200_PEAKS["tflops"], tbps=H200_PEAKS["tbps"]) -> tuple:
  """(forward, forward + backward) floor in ms: max(FLOP / peak FLOP/s, bytes / peak bytes/s)."""
  r = roofline(shape, io_bytes)
  ms = lambda flop, nbytes: 1e3 * max(flop / (tflops * 1e12), nbytes / (tbps * 1e12))
  return ms(r["fwd_flop"], r["fwd_bytes"]), ms(r["fb_flop"], r["fb_bytes"])


def plain_port(q, k, v, g, beta, *, chunk_size=64):
  """The baseline: how straightforward JAX ports write it. Per chunk, inside `lax.scan`: the masked
  triangular system by an explicit triangular solve, intra-chunk attention, state update; autodiff
  through everything (no rematerialisation). Per-head g and beta only. Shapes as `gated_delta_rule`."""
  B, T, H, K = q.shape
  V = v.shape[-1]
  C = chunk_size
  N = T // C
  f32 = lambda x: x.astype(jnp.float32)
  q, k, v, g, beta = f32(q) * K**-0.5, f32(k), f32(v), f32(g), f32(beta)
  to_chunks = lambda x: jnp.moveaxis(x.reshape((B, N, C) + x.shape[2:]), 1, 0)  # [N, B, C, H, ...]
  eye = jnp.eye(C, dtype=jnp.float32)
  lower = jnp.tril(jnp.ones((C, C), bool), -1)
  incl = jnp.tril(jnp.ones((C, C), bool))

  def body(S, xs):
    qc, kc, vc, gc, bc = xs  # [B, C, H, ...]
    gam = jnp.cumsum(gc, axis=1)  # [B, C, H]
    diff = gam[:, :, None, :] - gam[:, None, :, :]  # [B, C, C, H]
    decay = jnp.exp(jnp.where(incl[None, :, :, None], diff, -jnp.inf))
    kk = jnp.einsum("bthk,bihk->btih", kc, kc) * decay
    A = eye[None, :, :, None] + jnp.where(lower[None, :, :, None], kk * bc[:, :, None, :], 0.0)
    A = jnp.moveaxis(A, -1, 1)  # [B, H, C, C]
    rhs_w = jnp.moveaxis(kc * (bc * jnp.exp(gam))[..., None], 2, 1)
    rhs_u = jnp.moveaxis(vc * bc[..., None], 2, 1)
    w = jax.scipy.linalg.solve_triangular(A, rhs_w, lower=True)
    u = jax.scipy.linalg.solve_triangular(A, rhs_u, lower=True)
    u = u - jnp.einsum("bhck,bhkv->bhcv", w, S)
    qk = jnp.moveaxis(jnp.einsum("bthk,bihk->btih", qc, kc) * decay, -1, 1)
    qg = jnp.moveaxis(qc * jnp.exp(gam)[..., None], 2, 1)
    o = jnp.einsum("bhck,bhkv->bhcv", qg, S) + jnp.einsum("bhti,bhiv->bhtv", qk, u)
    gam_h = jnp.moveaxis(gam, -1, 1)  # [B, H, C]
    k_end = jnp.moveaxis(kc, 2, 1) * jnp.exp(gam_h[..., -1:] - gam_h)[..., None]
    S = S * jnp.exp(gam_h[..., -1])[..., None, None] + jnp.einsum("bhck,bhcv->bhkv", k_end, u)
    return S, jnp.moveaxis(o, 1, 2)

  S0 = jnp.zeros((B, H, K, V), jnp.float32)
  S, o = jax.lax.scan(body, S0, tuple(map(to_chunks, (q, k, v, g, beta))))
  return jnp.moveaxis(o, 0, 1).reshape(B, T, H, V), S


def make_fn(method, dims):
  """`method` is a gdn method name, "plain_port", or a chunk variant: "chunk_remat", "chunk_triangular",
  "chunk_blocked" (the triangular solver forced)."""
  if method == "plain_port":
    return lambda q, k, v, g, b: plain_port(q, k, v, g, b)[0].astype(v.dtype)
  impl, kw = _IMPLS.get(method), {}
  if method.startswith("chunk_"):
    impl, variant = chunk, method[len("chunk_"):]
    kw = dict(remat=True) if variant == "remat" else dict(solver=variant)

  def f(q, k, v, g, b):
    return impl(q, k, v, g, b, scale=dims.K**-0.5, initial_state=None, segment_ids=None, dims=dims,
                chunk_size=64, **kw)[0].astype(v.dtype)

  return f


def timed(fn, args, reps):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(1e3 * (time.perf_counter() - t0))
  return statistics.median(times)


def peak_bytes(jitted, args):
  """XLA's buffer assignment: arguments + outputs + temporaries of the compiled program."""
  m = jitted.lower(*args).compile().memory_analysis()
  if m is None:
    return float("nan")
  return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes


def inputs(shape, dtype):
  """q, k (unit rows), v, g (log-decays in [log 0.9, 0]), beta in (0, 1): the arrays every row times."""
  B, T, H, D = shape
  rng = np.random.default_rng(0)
  k = rng.normal(size=(B, T, H, D)).astype(np.float32)
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  args = [jnp.asarray(rng.normal(size=(B, T, H, D)), dtype), jnp.asarray(k, dtype),
          jnp.asarray(rng.normal(size=(B, T, H, D)), dtype),
          jnp.asarray(np.log(rng.uniform(0.9, 1.0, (B, T, H))), dtype),
          jnp.asarray(rng.uniform(0, 1, (B, T, H)), dtype)]
  return args, rng


def bench(shape, method, dtype, reps, skip_time=False):
  args, rng = inputs(shape, dtype)
  B, T, H, D = shape
  dims = checks.check_sequence(*args, None, None, None, "chunk", 64)
  f = make_fn(method, dims)
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


def pallas_prefixes(dims):
  """Three functions of (q, k, v, g, beta): `pallas` cut after each of its stages. `prepare` is the XLA chunk-
  local work (decays, A, its inverse, W, U, P), `state pass` the Pallas kernel (with its padding), `finish` the
  XLA output (Q S_in + P U). The last returns the op's output, as `gated_delta_rule(method="pallas")`."""

  def local(q, k, v, g, b):
    return prepare(q, k, v, g, b, scale=dims.K**-0.5, segment_ids=None, dims=dims, chunk_size=64)

  def stage1(*a):
    loc = local(*a)[0]  # only the fields the later stages read, so that no dead work is timed
    return loc.q_dec, loc.k_end, loc.decay, loc.P, loc.W, loc.U

  def stage2(*a):
    loc, _, _, _, cdt, prec = local(*a)
    _, S_in, U = pallas_chunk.state_pass(loc, initial(None, dims, cdt), prec)
    return loc.q_dec, loc.P, S_in, U

  def stage3(*a):
    loc, _, _, _, cdt, prec = local(*a)
    _, S_in, U = pallas_chunk.state_pass(loc, initial(None, dims, cdt), prec)
    return finish(loc, S_in, U, prec, dims, 64).astype(a[2].dtype)

  return stage1, stage2, stage3


def breakdown(shape, dtype, reps):
  """Times `pallas` cut after each stage, forward and forward+backward (the backward of a prefix is taken
  with fixed random cotangents for its outputs); a stage's cost is the difference of consecutive prefixes."""
  args, rng = inputs(shape, dtype)
  dims = checks.check_sequence(*args, None, None, None, "chunk", 64)
  rows = []
  for name, f in zip(STAGES, pallas_prefixes(dims)):
    cts = jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s.shape), s.dtype), jax.eval_shape(f, *args))

    def fwd_bwd(cts, *a, f=f):  # the cotangents are arguments: closed over, they would be compiled in as constants
      _, vjp = jax.vjp(f, *a)
      return vjp(cts)

    rows.append(dict(stage=name, fwd_ms=timed(jax.jit(f), args, reps),
                     fb_ms=timed(jax.jit(fwd_bwd), [cts] + args, reps)))
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


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
  p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
  p.add_argument("--methods", nargs="*", help="override the preset's methods")
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--shapes", nargs="*", help="override the preset's shapes, each as B,T,H,D")
  p.add_argument("--breakdown", action="store_true",
                 help="time method='pallas' cut after each of its stages (prepare, state pass, finish)")
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
