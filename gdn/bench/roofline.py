"""Roofline floors: the chunkwise gated delta rule's FLOP and bytes, a decode step's bytes, and the time they take
at a card's peaks."""

from __future__ import annotations

# The rates an H200 reaches (not measured by this script): an 8192^3 bf16 matrix product at about 790 TFLOP/s
# and a device-to-device copy at about 4.3 TB/s (bytes read plus written), both through PyTorch on the card.
H200_PEAKS = dict(tflops=790.0, tbps=4.3)
# The H200's HBM3e bandwidth on its data sheet (4.8 TB/s): the floor a decode step is held against.
H200_HBM_TBPS = 4.8


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


def decode_floor_ms(weight_bytes: int, state_bytes: int, tbps: float = H200_HBM_TBPS) -> float:
  """The floor of one decode step in ms: every weight read once (whatever the batch) plus the recurrent states
  and attention caches read and written (`state_bytes`), at `tbps` TB/s. FLOP are not counted: a step takes
  about 2 * batch * parameters, for 0.7e9 parameters at batch 64 0.09 TFLOP, 0.11 ms at 790 TFLOP/s, below the
  0.3 ms of reading their 1.4 GB in bfloat16."""
  return 1e3 * (weight_bytes + state_bytes) / (tbps * 1e12)
