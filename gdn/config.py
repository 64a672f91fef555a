"""Typed, frozen model configs. Modules receive these, never dictionaries.

A model is a stack of layers given by `ModelConfig.pattern`, one letter per layer, repeated cyclically to
`num_layers`: "R" a recurrent mixer of the delta-rule family (`RecurrentConfig`), "M" a second recurrent mixer with
its own config (`ModelConfig.mamba2`, by default Mamba2's gated linear attention: per-head decay, no delta rule),
"A" global softmax attention, "W" sliding-window softmax attention (`AttentionConfig`). "RRRA" is the 3:1 hybrid;
"MRW" the Gated DeltaNet paper's H2 (Mamba2, Gated DeltaNet, sliding window). `ModelConfig.mlp_pattern`
likewise picks each layer's MLP: "D" dense SwiGLU, "M" sparse mixture of experts (`MoEConfig`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from gdn.ops import checks, intra_chunk

DECAYS = ("none", "head", "channel")
BETAS = ("none", "head", "channel")
OUTPUT_GATES = ("none", "silu", "sigmoid")
QK_NORMS = ("none", "l2")
WRITE_SCALES = ("none", "dt")
LAYER_KINDS = {"R": "recurrent", "M": "mamba2", "A": "attention", "W": "sliding_window"}
MLP_KINDS = {"D": "dense", "M": "moe"}
REMATS = ("none", "dots", "dots_states", "full")
MIXER_REMATS = ("none", "features", "op", "layer")


def _choice(name: str, value, allowed) -> None:
  if value not in allowed:
    raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value!r}")


def _positive(name: str, value) -> None:
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclasses.dataclass(frozen=True)
class RecurrentConfig:
  """The delta-rule mixer family. Baselines are switch settings (see `PRESETS`).

  decay: "none" (DeltaNet / linear attention), "head" (Gated DeltaNet, Mamba2), "channel" (KDA).
  beta: "none" (no delta rule: linear attention, Mamba2-style gated linear attention), "head" (paper, fla),
    "channel" (the seed's reference class). allow_neg_eigval doubles beta into (0, 2).
  """
  num_heads: int = 4  # q/k heads H
  num_v_heads: Optional[int] = None  # value heads HV (None = num_heads); a multiple of num_heads
  head_dim: int = 32  # K
  v_head_dim: Optional[int] = None  # V (None = head_dim)
  decay: str = "head"
  beta: str = "head"
  allow_neg_eigval: bool = False
  # "dt": each token's write scaled by its step size dt = softplus(W_a x + dt_bias) (per head; v becomes dt * v),
  # the one that also sets the decay g = -exp(A_log) dt: Mamba2's discretisation h_t = exp(dt A) h_{t-1} + dt B x,
  # with which a token of small dt is neither written nor lets the state decay. Needs decay "head".
  write_scale: str = "none"
  short_conv: bool = True
  conv_size: int = 4
  conv_bias: bool = False  # a per-channel bias in the short conv (fla's conv_bias=True); needs short_conv
  silu_without_conv: bool = False  # SiLU on q, k, v when short_conv is off, as fla's layers do without their conv
  output_gate: str = "silu"
  output_gate_rank: Optional[int] = None  # None: full-rank W_g; R: W_g2 (W_g1 x) + b_g through rank R (fla's KDA)
  output_norm: bool = True
  qk_norm: str = "l2"
  qkv_bias: bool = False
  out_bias: bool = False
  decay_low_rank: int = 16  # rank of the KDA per-channel decay projection
  # None: g = -exp(A_log) softplus(a + dt_bias) (unbounded below). LB in [-5, 0): fla's bounded KDA gate
  # g = LB sigmoid(exp(A_log) (a + dt_bias)), in (LB, 0), and the op told so (`gated_delta_rule(g_lower_bound=LB)`:
  # a per-key-channel decay's chunk-local products as matmuls); with dt_init "fla", A_log starts at 0 (A = 1), as
  # fla's KDA layer with safe_gate.
  gate_lower_bound: Optional[float] = None
  dt_init: str = "fla"  # "fla": dt_bias = softplus^-1(log-uniform[1e-3, 0.1]), A ~ U(1, 16); "seed": dt_bias = 1, A ~ U(0, 16)
  dropout: float = 0.0
  norm_eps: float = 1e-6  # output RMSNorm (the seed's nn.RMSNorm(head_dim, eps=1e-6))
  method: str = "auto"
  chunk_size: int = 64
  # What the mixer's backward keeps (training without a cache; `RecurrentMixer`): "none" every intermediate;
  # "features" none of the short conv's, its SiLU's and the q/k norm's (they run again from the projections);
  # "op" only the op's inputs q, k, v, g, beta (its chunk-local work and states run again in the backward);
  # "layer" only the projections of x: short conv, SiLU, l2norm, gates, the op and the output norm run again.
  remat: str = "none"
  # The op's backward of its chunk-local work over this many groups of chunks, one group at a time (less memory,
  # the same values to float32 rounding; `gated_delta_rule(local_groups=...)`); 1: all chunks at once.
  local_groups: int = 1

  def __post_init__(self):
    _positive("num_heads", self.num_heads)
    _positive("head_dim", self.head_dim)
    _positive("conv_size", self.conv_size)
    _positive("chunk_size", self.chunk_size)
    _positive("local_groups", self.local_groups)
    if self.num_v_heads is not None:
      _positive("num_v_heads", self.num_v_heads)
    if self.num_v_heads is not None and self.num_v_heads % self.num_heads:
      raise ValueError(f"num_v_heads must be a positive multiple of num_heads={self.num_heads}, "
                       f"got {self.num_v_heads}")
    _choice("decay", self.decay, DECAYS)
    _choice("beta", self.beta, BETAS)
    _choice("output_gate", self.output_gate, OUTPUT_GATES)
    _choice("qk_norm", self.qk_norm, QK_NORMS)
    _choice("write_scale", self.write_scale, WRITE_SCALES)
    if self.write_scale == "dt" and self.decay != "head":
      raise ValueError(f"write_scale='dt' scales each write by the per-head decay's step size, so it needs "
                       f"decay='head', got decay={self.decay!r}")
    _choice("dt_init", self.dt_init, ("fla", "seed"))
    _choice("method", self.method, checks.METHODS)
    _choice("remat", self.remat, MIXER_REMATS)
    _positive("decay_low_rank", self.decay_low_rank)
    if self.output_gate_rank is not None:
      _positive("output_gate_rank", self.output_gate_rank)
      if self.output_gate == "none":
        raise ValueError(f"output_gate_rank needs an output gate, got output_gate_rank={self.output_gate_rank} "
                         f"with output_gate='none'")
    if self.conv_bias and not self.short_conv:
      raise ValueError("conv_bias needs the short conv, got conv_bias=True with short_conv=False")
    if self.silu_without_conv and self.short_conv:
      raise ValueError("silu_without_conv is for short_conv=False (SiLU always follows the conv), got "
                       "silu_without_conv=True with short_conv=True")
    if self.v_head_dim is not None:
      _positive("v_head_dim", self.v_head_dim)
    if self.allow_neg_eigval and self.beta == "none":
      raise ValueError("allow_neg_eigval=True needs a delta rule (beta 'head' or 'channel'), got beta='none'")
    if not 0.0 <= self.dropout < 1.0:
      raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
    if not self.norm_eps > 0:
      raise ValueError(f"norm_eps must be > 0, got {self.norm_eps}")
    if self.gate_lower_bound is not None:
      if self.decay == "none":
        raise ValueError(f"gate_lower_bound bounds the decay gate, got gate_lower_bound={self.gate_lower_bound} "
                         f"with decay='none'")
      checks.check_g_lower_bound(self.gate_lower_bound, True, intra_chunk.MIN_G_LOWER_BOUND, "gate_lower_bound")

  @property
  def HV(self) -> int:
    return self.num_v_heads or self.num_heads

  @property
  def V(self) -> int:
    return self.v_head_dim or self.head_dim


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """Causal softmax attention with RoPE and GQA; Qwen3-Next's gated attention is output_gate="sigmoid"."""
  num_heads: int = 4
  num_kv_heads: Optional[int] = None  # None = num_heads
  head_dim: int = 32
  rope_theta: float = 10000.0
  rope_fraction: float = 1.0  # partial rotary: the first fraction of each head's dims rotate
  window: int = 0  # sliding window size for "W" layers
  output_gate: str = "none"  # "none" | "sigmoid"
  qk_norm: bool = False  # RMSNorm on q and k per head
  proj_bias: bool = False  # biases on the q, k, v and o projections (Qwen3-Next's attention_bias=True)
  implementation: str = "auto"  # jax.nn.dot_product_attention backend: "auto" (cuDNN for 16-bit on GPU), "xla", "cudnn"
  # RoPE scaling (gdn.layers.rope): "none", or "yarn" (arXiv:2309.00071) with the fields below.
  rope_scaling: str = "none"
  rope_factor: float = 1.0  # context extension factor: the slow frequencies are divided by it
  rope_original_max_len: int = 0  # the context length trained with plain RoPE (yarn needs it)
  rope_beta_fast: float = 32.0  # dims turning more than beta_fast times over that length keep their frequency
  rope_beta_slow: float = 1.0  # dims turning fewer than beta_slow times are fully interpolated
  rope_attention_factor: Optional[float] = None  # cos/sin magnitude; None: 0.1 ln(rope_factor) + 1
  rope_truncate: bool = True  # round the ramp's ends to whole dims

  def __post_init__(self):
    _positive("num_heads", self.num_heads)
    _positive("head_dim", self.head_dim)
    if self.num_kv_heads is not None:
      _positive("num_kv_heads", self.num_kv_heads)
    if self.num_kv_heads is not None and self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_kv_heads must divide num_heads={self.num_heads}, got {self.num_kv_heads}")
    if not 0.0 <= self.rope_fraction <= 1.0:
      raise ValueError(f"rope_fraction must be in [0, 1], got {self.rope_fraction}")
    if not isinstance(self.window, int) or isinstance(self.window, bool) or self.window < 0:
      raise ValueError(f"window must be an int >= 0 (0: global attention), got {self.window!r}")
    if not self.rope_theta > 0:
      raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
    _choice("output_gate", self.output_gate, ("none", "sigmoid"))
    _choice("implementation", self.implementation, ("auto", "xla", "cudnn"))
    _choice("rope_scaling", self.rope_scaling, ("none", "yarn"))
    if self.rope_scaling == "yarn":
      if not self.rope_factor >= 1.0:
        raise ValueError(f"rope_factor must be >= 1 for rope_scaling='yarn', got {self.rope_factor}")
      _positive("rope_original_max_len", self.rope_original_max_len)
      if not self.rope_beta_fast > self.rope_beta_slow > 0:
        raise ValueError(f"rope_beta_fast > rope_beta_slow > 0 is needed, got {self.rope_beta_fast}, "
                         f"{self.rope_beta_slow}")

  @property
  def KVH(self) -> int:
    return self.num_kv_heads or self.num_heads


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """A sparse mixture-of-experts SwiGLU MLP (`gdn.layers.moe`), used by the layers that `ModelConfig.mlp_pattern`
  marks "M": a softmax router picks top_k of num_experts per token; an optional shared expert (with a sigmoid
  gate) sees every token."""
  num_experts: int = 8
  top_k: int = 2
  hidden: int = 64  # each expert's SwiGLU width
  shared_hidden: int = 0  # the shared expert's width; 0: none
  shared_gate: bool = True  # scale the shared expert by sigmoid(x . w) (Qwen3-Next)
  norm_topk: bool = True  # renormalise the top_k probabilities to sum to one
  aux_loss_coef: float = 0.01  # weight of the load-balancing loss in the training loss

  def __post_init__(self):
    _positive("num_experts", self.num_experts)
    _positive("top_k", self.top_k)
    _positive("hidden", self.hidden)
    if self.top_k > self.num_experts:
      raise ValueError(f"top_k must be <= num_experts={self.num_experts}, got {self.top_k}")
    if not isinstance(self.shared_hidden, int) or self.shared_hidden < 0:
      raise ValueError(f"shared_hidden must be an int >= 0 (0: no shared expert), got {self.shared_hidden!r}")
    if not self.aux_loss_coef >= 0:
      raise ValueError(f"aux_loss_coef must be >= 0, got {self.aux_loss_coef}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab_size: int = 256
  d_model: int = 128
  num_layers: int = 4
  pattern: str = "RRRA"
  recurrent: RecurrentConfig = RecurrentConfig()
  # The "M" layers' mixer: one model can hold two recurrent kinds (the paper's H2 stacks Mamba2 and Gated DeltaNet).
  mamba2: RecurrentConfig = RecurrentConfig(decay="head", beta="none")
  attention: AttentionConfig = AttentionConfig()
  mlp_ratio: float = 4.0  # SwiGLU hidden = round(mlp_ratio * 2/3 * d_model) to a multiple of 8; 0 = no MLP
  tie_embeddings: bool = True
  norm_eps: float = 1e-6
  init_std: float = 0.02
  dtype: str = "float32"  # compute dtype ("float32" | "bfloat16"); parameters stay float32
  mlp_hidden: Optional[int] = None  # the dense SwiGLU's width; None: from mlp_ratio
  mlp_pattern: str = "D"  # one letter per layer, cyclic like pattern: "D" dense SwiGLU, "M" MoE (`moe`)
  moe: MoEConfig = MoEConfig()
  # Scan over layers: the pattern's group of blocks is stacked and applied num_layers // len(pattern) times by
  # one `lax.scan` (compiled once whatever the depth); the num_layers % len(pattern) left over run unrolled after.
  scan_layers: bool = False
  # Rematerialisation in the backward pass, per block (unrolled) or per scanned group: "none" keeps every
  # activation, "dots" keeps only matmul outputs without batch dimensions (the projections), "dots_states" those
  # and the chunked recurrence's per-chunk states and write vectors (its sequential pass is not run again), "full"
  # keeps only each unit's input.
  remat: str = "none"

  def __post_init__(self):
    _positive("vocab_size", self.vocab_size)
    _positive("d_model", self.d_model)
    _positive("num_layers", self.num_layers)
    if not self.pattern or set(self.pattern) - set(LAYER_KINDS):
      raise ValueError(f"pattern must be a non-empty string of {sorted(LAYER_KINDS)} "
                       f"(R recurrent, M second recurrent, A attention, W sliding window), got {self.pattern!r}")
    if not isinstance(self.tie_embeddings, bool):
      raise ValueError(f"tie_embeddings must be a bool, got {self.tie_embeddings!r}")
    if "W" in self.pattern and self.attention.window < 1:
      raise ValueError("pattern has sliding-window layers 'W' but attention.window is 0")
    _choice("dtype", self.dtype, ("float32", "bfloat16"))
    for name in ("norm_eps", "init_std"):
      if not getattr(self, name) > 0:  # NaN too
        raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
    if not self.mlp_ratio >= 0:  # NaN too
      raise ValueError(f"mlp_ratio must be >= 0 (0: blocks without an MLP), got {self.mlp_ratio}")
    if self.mlp_hidden is not None:
      _positive("mlp_hidden", self.mlp_hidden)
    if not self.mlp_pattern or set(self.mlp_pattern) - set(MLP_KINDS):
      raise ValueError(f"mlp_pattern must be a non-empty string of {sorted(MLP_KINDS)} (D dense, M mixture of "
                       f"experts), got {self.mlp_pattern!r}")
    _choice("remat", self.remat, REMATS)
    if not isinstance(self.scan_layers, bool):
      raise ValueError(f"scan_layers must be a bool, got {self.scan_layers!r}")
    if (self.scan_layers or self.remat != "none") and "moe" in self.mlp_kinds:
      raise ValueError(f"MoE layers (mlp_pattern with 'M') need the unrolled layers without remat, got "
                       f"scan_layers={self.scan_layers}, remat={self.remat!r}: set scan_layers=False, remat='none'")
    if self.scan_layers and self.num_layers < len(self.pattern):
      raise ValueError(f"scan_layers needs at least one whole pattern group: num_layers={self.num_layers} < "
                       f"len(pattern)={len(self.pattern)} ({self.pattern!r})")

  @property
  def scan_groups(self) -> int:
    """How many times the scan applies the pattern's group of blocks (0 without scan_layers)."""
    return self.num_layers // len(self.pattern) if self.scan_layers else 0

  @property
  def layer_kinds(self) -> tuple:
    """One of "recurrent", "mamba2", "attention", "sliding_window" per layer."""
    return tuple(LAYER_KINDS[self.pattern[i % len(self.pattern)]] for i in range(self.num_layers))

  def mixer_config(self, kind: str) -> RecurrentConfig:
    """The RecurrentConfig of a recurrent layer kind ("recurrent" or "mamba2")."""
    return self.mamba2 if kind == "mamba2" else self.recurrent

  @property
  def mlp_kinds(self) -> tuple:
    """"dense" or "moe" per layer."""
    return tuple(MLP_KINDS[self.mlp_pattern[i % len(self.mlp_pattern)]] for i in range(self.num_layers))


# Named mixer baselines: one mechanism (switches on RecurrentConfig), no copied code.
PRESETS = {
    "linear_attention": dict(decay="none", beta="none", output_gate="none", output_norm=True),
    "gla_mamba2": dict(decay="head", beta="none"),
    # dt (about 1e-3 to 0.1 at init) scales each write, so the op's output starts near 1e-10 in mean square: under
    # the default eps of the output norm, which would then pass eps, not the signal (docs/models.md, "Write scale").
    "mamba2": dict(decay="head", beta="none", write_scale="dt", norm_eps=1e-12),
    "deltanet": dict(decay="none", beta="head"),
    "gated_deltanet": dict(decay="head", beta="head"),
    "kda": dict(decay="channel", beta="head", output_gate="sigmoid"),
    "seed": dict(decay="head", beta="channel", short_conv=False, qkv_bias=False, out_bias=True,
                 dt_init="seed", output_gate="silu", output_norm=True),
}


def recurrent_preset(name: str, **overrides) -> RecurrentConfig:
  if name not in PRESETS:
    raise ValueError(f"unknown recurrent preset {name!r}; choose from {sorted(PRESETS)}")
  return RecurrentConfig(**{**PRESETS[name], **overrides})
