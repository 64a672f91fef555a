"""Decoding-cache memory of a model config: attention K/V, recurrent state S and short-conv windows, in bytes.

The layouts are those of `gdn.model.LanguageModel.init_cache` (a test holds the two equal byte for byte):
  attention layer   K and V [B, L, KVH, E] in the cache dtype, L = context (global) or min(window, context)
                    (sliding window), plus the slot positions [L] and the token counter [] in int32;
  recurrent layer   S [B, HV, K, V] in the state dtype (float32 in our model: a long recurrence accumulated in
                    bfloat16 drifts), plus the short conv's last W-1 inputs [B, W-1, 2*H*K + HV*V] in the cache dtype.

Units, stated because the seed's table (section 6.6.6) mixes them: its KV column "1.50 / 12.00 / 48.00 GB" is GiB
(2^30 bytes: 48 layers x 4096 tokens x 16 heads x 128 x 2 (K, V) x 2 bytes = 1,610,612,736 bytes = 1.50 GiB,
1.61 GB), while its state "about 25.17 MB" is decimal MB (10^6 bytes: 48 x 16 x 128 x 128 x 2 = 25,165,824 bytes
= 25.17 MB, 24.00 MiB). This module prints both units and never writes a bare "GB".
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Optional, Sequence

import jax.numpy as jnp

from gdn.config import AttentionConfig, ModelConfig, RecurrentConfig

GiB = 2**30
MiB = 2**20
MB = 10**6
INDEX_BYTES = 4  # int32 slot positions and token counter of an attention cache


@dataclasses.dataclass(frozen=True)
class CacheBytes:
  """Bytes of a decoding cache, by kind."""
  kv: int = 0  # attention keys and values
  state: int = 0  # recurrent state S
  conv: int = 0  # short-conv windows
  index: int = 0  # attention slot positions and token counters

  @property
  def total(self) -> int:
    return self.kv + self.state + self.conv + self.index

  def __add__(self, other: "CacheBytes") -> "CacheBytes":
    return CacheBytes(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


def itemsize(dtype) -> int:
  """Bytes per element of a dtype given as a name ("bfloat16") or a dtype object."""
  try:
    return jnp.dtype(dtype).itemsize
  except TypeError as e:
    raise ValueError(f"dtype must name an array dtype such as 'bfloat16' or 'float32', got {dtype!r}") from e


def _check(cfg, batch, context=1):
  if not isinstance(cfg, ModelConfig):
    raise TypeError(f"cfg must be a gdn.config.ModelConfig, got {type(cfg).__name__}")
  for name, value in (("batch", batch), ("context", context)):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"{name} must be a positive int, got {value!r}")


def attention_slots(cfg: ModelConfig, kind: str, context: int) -> int:
  """Cache slots L of one attention layer: every token for global attention, the window for sliding window."""
  if kind == "sliding_window":
    return min(cfg.attention.window, context)
  return context


def layer_cache_bytes(cfg: ModelConfig, batch: int, context: int, *, dtype=None,
                      state_dtype="float32") -> tuple:
  """One `CacheBytes` per layer for `batch` sequences and a cache of `context` tokens.

  dtype: the K/V and conv-window dtype (None: cfg.dtype, the compute dtype the model caches in).
  state_dtype: the dtype of S (our model keeps it in float32; the seed's table counts it in bfloat16).
  """
  _check(cfg, batch, context)
  cache_size = itemsize(cfg.dtype if dtype is None else dtype)
  state_size = itemsize(state_dtype)
  a = cfg.attention
  out = []
  for kind in cfg.layer_kinds:
    if kind in ("recurrent", "mamba2"):
      r = cfg.mixer_config(kind)
      conv = batch * (r.conv_size - 1) * (2 * r.num_heads * r.head_dim + r.HV * r.V) * cache_size if r.short_conv else 0
      out.append(CacheBytes(state=batch * r.HV * r.head_dim * r.V * state_size, conv=conv))
    else:
      L = attention_slots(cfg, kind, context)
      out.append(CacheBytes(kv=2 * batch * L * a.KVH * a.head_dim * cache_size, index=(L + 1) * INDEX_BYTES))
  return tuple(out)


def cache_bytes(cfg: ModelConfig, batch: int, context: int, *, dtype=None, state_dtype="float32") -> CacheBytes:
  """The whole model's decoding cache; `.total` equals the nbytes of `LanguageModel.init_cache(batch, context)`."""
  total = CacheBytes()
  for layer in layer_cache_bytes(cfg, batch, context, dtype=dtype, state_dtype=state_dtype):
    total = total + layer
  return total


def kv_cache_bytes(cfg: ModelConfig, batch: int, context: int, dtype=None) -> int:
  """Bytes of the attention layers' keys and values (the seed's KV_std = B L n H d 2 2 for bfloat16)."""
  return cache_bytes(cfg, batch, context, dtype=dtype).kv


def recurrent_state_bytes(cfg: ModelConfig, batch: int, dtype="float32") -> int:
  """Bytes of the recurrent layers' states S (the seed's State_GDN = B L H d d 2 for bfloat16); no context term."""
  return cache_bytes(cfg, batch, 1, state_dtype=dtype).state


def conv_state_bytes(cfg: ModelConfig, batch: int, dtype=None) -> int:
  """Bytes of the recurrent layers' short-conv windows (the last W-1 inputs of q, k and v)."""
  return cache_bytes(cfg, batch, 1, dtype=dtype).conv


def seed_config(pattern: str = "A", **overrides) -> ModelConfig:
  """The seed's section 6.6.6 model: emb_dim 2048, 16 heads of head_dim 128, 48 layers, bfloat16, its mixer
  without short conv. pattern "A" is its attention model, "R" its Gated DeltaNet, "RRRA" the 3:1 hybrid."""
  fields = dict(vocab_size=1, d_model=2048, num_layers=48, pattern=pattern, dtype="bfloat16",
                recurrent=RecurrentConfig(num_heads=16, head_dim=128, short_conv=False),
                attention=AttentionConfig(num_heads=16, head_dim=128))
  return ModelConfig(**{**fields, **overrides})


def _ints(text: str) -> list:
  try:
    values = [int(s.replace("_", "")) for s in text.split(",") if s.strip()]
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
  if not values or min(values) < 1:
    raise argparse.ArgumentTypeError(f"expected positive ints, got {text!r}")
  return values


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="gdn-memory",
      description="Decoding-cache bytes (attention K/V, recurrent state, short-conv windows) per layer pattern and "
                  "context length. The defaults are the seed's section 6.6.6 setup; its 'GB' are GiB (2^30 bytes) "
                  "and its 'MB' are 10^6 bytes.")
  p.add_argument("--patterns", default="A,R,RRRA",
                 help="comma-separated layer patterns (R recurrent, A attention, W sliding window); default A,R,RRRA")
  p.add_argument("--contexts", type=_ints, default=[4096, 32768, 131072], help="comma-separated context lengths")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--d-model", type=int, default=2048)
  p.add_argument("--layers", type=int, default=48)
  p.add_argument("--heads", type=int, default=16, help="attention heads and recurrent q/k heads")
  p.add_argument("--head-dim", type=int, default=128, help="attention head dim and recurrent key dim K")
  p.add_argument("--kv-heads", type=int, default=None, help="attention K/V heads (GQA); default --heads")
  p.add_argument("--v-heads", type=int, default=None, help="recurrent value heads HV; default --heads")
  p.add_argument("--v-head-dim", type=int, default=None, help="recurrent value dim V; default --head-dim")
  p.add_argument("--conv-size", type=int, default=0, help="short conv kernel size (0: none, as in the seed)")
  p.add_argument("--window", type=int, default=0, help="sliding-window size of 'W' layers")
  p.add_argument("--dtype", default="bfloat16", help="K/V and conv-window dtype")
  p.add_argument("--state-dtype", default="bfloat16",
                 help="recurrent state dtype (bfloat16 in the seed's table; gdn.model keeps S in float32)")
  return p


def _config(args, pattern: str) -> ModelConfig:
  recurrent = RecurrentConfig(num_heads=args.heads, head_dim=args.head_dim, num_v_heads=args.v_heads,
                              v_head_dim=args.v_head_dim, short_conv=args.conv_size > 0,
                              conv_size=max(args.conv_size, 1))
  attention = AttentionConfig(num_heads=args.heads, head_dim=args.head_dim, num_kv_heads=args.kv_heads,
                              window=args.window)
  # ModelConfig admits float32 and bfloat16 only; the byte counts take args.dtype directly.
  dtype = args.dtype if args.dtype in ("float32", "bfloat16") else "float32"
  return ModelConfig(vocab_size=1, d_model=args.d_model, num_layers=args.layers, pattern=pattern, dtype=dtype,
                     recurrent=recurrent, attention=attention)


def table(args) -> str:
  patterns = [s.strip() for s in args.patterns.split(",") if s.strip()]
  cfgs = {p: _config(args, p) for p in patterns}
  first = cfgs[patterns[0]]
  r = first.recurrent
  lines = [
      f"Decoding cache, batch {args.batch}: d_model {args.d_model}, {args.layers} layers; attention {args.heads} "
      f"heads ({first.attention.KVH} K/V) x {args.head_dim}; recurrent {r.num_heads} q/k heads x K {r.head_dim}, "
      f"{r.HV} value heads x V {r.V}, conv {'off' if not r.short_conv else r.conv_size}.",
      f"K/V and conv windows in {args.dtype}, recurrent state in {args.state_dtype}. "
      f"GiB = 2^30 bytes, MiB = 2^20 bytes, MB = 10^6 bytes.",
      "",
      f"{'pattern':<10}{'context':>9}{'KV GiB':>10}{'state MB':>11}{'state MiB':>11}{'conv MB':>10}{'slots MB':>10}"
      f"{'total GiB':>11}{'total bytes':>17}{'vs ' + patterns[0]:>10}",
  ]
  for n in args.contexts:
    base = None
    for p in patterns:
      c = cache_bytes(cfgs[p], args.batch, n, dtype=args.dtype, state_dtype=args.state_dtype)
      base = c.total if base is None else base
      ratio = base / c.total if c.total else float("inf")
      lines.append(f"{p:<10}{n:>9}{c.kv / GiB:>10.2f}{c.state / MB:>11.2f}{c.state / MiB:>11.2f}"
                   f"{c.conv / MB:>10.2f}{c.index / MB:>10.2f}{c.total / GiB:>11.4f}{c.total:>17,}{ratio:>9.1f}x")
  lines += ["", "slots: the attention caches' int32 slot positions and token counter (4 bytes per slot, + 4).",
            "The seed's section 6.6.6 'GB' are GiB (its 1.50 / 12.00 / 48.00) and its '25.17 MB' is 10^6 bytes."]
  return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = _parser()
  args = parser.parse_args(argv)
  try:
    itemsize(args.dtype), itemsize(args.state_dtype)
    print(table(args))
  except ValueError as e:
    parser.error(str(e))
  return 0


if __name__ == "__main__":
  sys.exit(main())
