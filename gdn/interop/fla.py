"""Import flash-linear-attention's `fla.layers.GatedDeltaNet` and `fla.layers.KimiDeltaAttention` into
`RecurrentMixer`.

Both layers: q_proj / k_proj [H*K, D], v_proj [HV*V, D], b_proj [HV, D], A_log [HV], o_norm over V, o_proj
[D, HV*V], no projection biases. With use_short_conv, q_conv1d / k_conv1d / v_conv1d are depthwise [C, 1, W]
weights (and [C] biases with conv_bias=True) followed by SiLU; without it, fla takes SiLU of the projections.
Their kernels L2-normalise q and k (eps 1e-6), scale q by K^-0.5, take beta = sigmoid(b) (x2 with
allow_neg_eigval), and value head i reads q/k head i // (HV // H), as ours.

GatedDeltaNet: a_proj [HV, D], dt_bias [HV], g = -exp(A_log) * softplus(a + dt_bias) per head; g_proj [HV*V, D]
with o_norm = FusedRMSNormGated(V) (swish or sigmoid), or a plain RMSNorm(V) without the gate: the paper preset.
KimiDeltaAttention: f_proj = Linear(D, V) then Linear(V, HV*K), dt_bias [HV*K], g = -exp(A_log) * softplus(f +
dt_bias) per key channel (decay "channel", decay_low_rank V); g_proj = Linear(D, V) then Linear(V, HV*V) with a
bias (output_gate_rank V), o_norm = FusedRMSNormGated(V, activation="sigmoid"): the kda preset.
"""

from __future__ import annotations

import math
from typing import Mapping, Optional

import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdn.config import AttentionConfig, ModelConfig, RecurrentConfig
from gdn.interop import causal_lm
from gdn.interop.state_dict import Tensors, assign, field, linear, target
from gdn.layers.mlp import hidden_size
from gdn.layers.recurrent import RecurrentMixer
from gdn.model import LanguageModel

LAYER_NORM_EPS = 1e-5  # the fla layers' default; fla's models pass config.norm_eps (1e-6 by default)
GATES = {"swish": "silu", "silu": "silu", "sigmoid": "sigmoid"}


def _picker(fla_config):
  """pick(value, name, default): the keyword if given, else `fla_config`'s field, else the layer's default."""
  def pick(value, name, default):
    if value is not None:
      return value
    return default if fla_config is None else field(fla_config, name, default)
  return pick


def _short_conv(t: Tensors) -> dict:
  """Our short-conv fields from the weights: the conv and its bias if present, else fla's SiLU without it."""
  if "q_conv1d.weight" not in t:
    return dict(short_conv=False, silu_without_conv=True)
  return dict(short_conv=True, conv_size=t.shape("q_conv1d.weight")[-1], conv_bias="q_conv1d.bias" in t)


def _short_conv_params(t: Tensors, cfg: RecurrentConfig) -> dict:
  """Our one conv over the concatenated [q | k | v] channels (weight [W, C], bias [C]) from fla's three."""
  if not cfg.short_conv:
    return {}
  H, HV, K, V, W = cfg.num_heads, cfg.HV, cfg.head_dim, cfg.V, cfg.conv_size
  channels = (("q", H * K), ("k", H * K), ("v", HV * V))
  conv = {"weight": np.concatenate([t.take(f"{n}_conv1d.weight", (c, 1, W))[:, 0, :] for n, c in channels], 0).T}
  if cfg.conv_bias:
    conv["bias"] = np.concatenate([t.take(f"{n}_conv1d.bias", (c,)) for n, c in channels])
  return {"conv": conv}


def mixer_config(state_dict, *, prefix: str = "", fla_config=None, num_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, allow_neg_eigval: Optional[bool] = None,
                 norm_eps: Optional[float] = None, output_gate_activation: Optional[str] = None,
                 **overrides) -> tuple:
  """(RecurrentConfig, d_model) of the fla GatedDeltaNet whose weights are `state_dict` (a mapping or safetensors
  path).

  The weights show HV (A_log), V (o_norm), H*K (q_proj), d_model, whether the gate and short conv are on, and the
  conv's W and bias. The rest comes from the keywords, else from `fla_config` (a `GatedDeltaNetConfig` or its
  config.json dict), else from the layer's defaults: num_heads or head_dim (one is needed), allow_neg_eigval
  (False), norm_eps (1e-5), output_gate_activation ("swish"). `overrides` set our fields that fla has no
  counterpart for (method, ...).
  """
  t = state_dict if isinstance(state_dict, Tensors) else Tensors(state_dict, prefix)
  pick = _picker(fla_config)
  num_heads, head_dim = pick(num_heads, "num_heads", None), pick(head_dim, "head_dim", None)
  allow_neg_eigval = bool(pick(allow_neg_eigval, "allow_neg_eigval", False))
  norm_eps = float(pick(norm_eps, "norm_eps", LAYER_NORM_EPS))
  activation = pick(output_gate_activation, "output_gate_activation", "swish")
  if activation not in GATES:
    raise ValueError(f"output_gate_activation must be one of {tuple(GATES)}, got {activation!r}")

  (HV,) = t.shape("A_log")
  (V,) = t.shape("o_norm.weight")
  HK, D = t.shape("q_proj.weight")
  if num_heads is None and head_dim is None:
    raise ValueError("num_heads or head_dim is needed (the weights only show num_heads * head_dim = "
                     f"{HK}): pass it, or fla_config")
  H = num_heads if num_heads is not None else HK // head_dim
  K = head_dim if head_dim is not None else HK // num_heads
  if H * K != HK:
    raise ValueError(f"num_heads={num_heads} and head_dim={head_dim} do not match q_proj.weight's {HK} rows")
  gated = "g_proj.weight" in t
  cfg = RecurrentConfig(num_heads=H, num_v_heads=HV, head_dim=K, v_head_dim=V, decay="head", beta="head",
                        allow_neg_eigval=allow_neg_eigval, **_short_conv(t),
                        output_gate=GATES[activation] if gated else "none", output_norm=True, qk_norm="l2",
                        norm_eps=norm_eps, **overrides)
  return cfg, D


def mixer_params(state_dict, cfg: RecurrentConfig, d_model: int, *, prefix: str = "") -> dict:
  """Nested NumPy params of `RecurrentMixer(cfg, d_model)` from the fla GatedDeltaNet's state_dict; every tensor
  is used."""
  t = state_dict if isinstance(state_dict, Tensors) else Tensors(state_dict, prefix)
  H, HV, K, V, D = cfg.num_heads, cfg.HV, cfg.head_dim, cfg.V, d_model
  p = {
      "q_proj": linear(t, "q_proj", D, H * K),
      "k_proj": linear(t, "k_proj", D, H * K),
      "v_proj": linear(t, "v_proj", D, HV * V),
      **_short_conv_params(t, cfg),
      "a_proj": linear(t, "a_proj", D, HV),
      "b_proj": linear(t, "b_proj", D, HV),
      "A_log": t.take("A_log", (HV,)),
      "dt_bias": t.take("dt_bias", (HV,)),
      "o_norm": {"weight": t.take("o_norm.weight", (V,))},
      "o_proj": linear(t, "o_proj", HV * V, D),
  }
  if cfg.output_gate != "none":
    p["g_proj"] = linear(t, "g_proj", D, HV * V)
  t.check_consumed()
  return p


def load_mixer(state_dict, *, prefix: str = "", module: Optional[RecurrentMixer] = None, dtype=jnp.float32,
               rngs: Optional[nnx.Rngs] = None, **config) -> RecurrentMixer:
  """A `RecurrentMixer` holding the fla GatedDeltaNet's weights (filled in place when `module` is given).

  state_dict: the layer's `state_dict()`, any mapping of names to tensors, or a safetensors path; prefix selects
  one layer of a model checkpoint (e.g. "model.layers.0.attn."). `config`: `mixer_config`'s keywords.
  """
  t = Tensors(state_dict, prefix)
  cfg, d_model = mixer_config(t, **config)
  module = target(module, lambda: RecurrentMixer(cfg, d_model, dtype=dtype, rngs=rngs or nnx.Rngs(0)), cfg, d_model)
  return assign(module, mixer_params(t, cfg, d_model))


def kda_config(state_dict, *, prefix: str = "", fla_config=None, allow_neg_eigval: Optional[bool] = None,
               norm_eps: Optional[float] = None, lower_bound: Optional[float] = None, **overrides) -> tuple:
  """(RecurrentConfig, d_model) of the fla KimiDeltaAttention whose weights are `state_dict`.

  The weights show every size: HV (A_log), K (dt_bias holds HV*K), H (q_proj's H*K rows), V (o_norm), the ranks
  of f_proj and g_proj, d_model, the short conv. allow_neg_eigval (False), norm_eps (1e-5) and lower_bound (None)
  come from the keywords, else from `fla_config` (a `KDAConfig` or its config.json dict), else the layer's
  defaults. A lower_bound (fla's bounded gate lower_bound * sigmoid(exp(A_log) * (f + dt_bias)), which its
  safe_gate needs) is our `gate_lower_bound`, in [-5, 0). `overrides` set our fields that fla has no counterpart
  for.
  """
  t = state_dict if isinstance(state_dict, Tensors) else Tensors(state_dict, prefix)
  pick = _picker(fla_config)
  allow_neg_eigval = bool(pick(allow_neg_eigval, "allow_neg_eigval", False))
  norm_eps = float(pick(norm_eps, "norm_eps", LAYER_NORM_EPS))
  lower_bound = pick(lower_bound, "lower_bound", None)
  lower_bound = None if lower_bound is None else float(lower_bound)

  (HV,) = t.shape("A_log")
  (HVK,) = t.shape("dt_bias")
  (V,) = t.shape("o_norm.weight")
  HK, D = t.shape("q_proj.weight")
  if HVK % HV:
    raise ValueError(f"state_dict: dt_bias has {HVK} entries, not a multiple of num_v_heads={HV} (from A_log)")
  K = HVK // HV
  if HK % K:
    raise ValueError(f"state_dict: q_proj.weight has {HK} rows, not a multiple of head_dim={K} (dt_bias / A_log)")
  cfg = RecurrentConfig(num_heads=HK // K, num_v_heads=HV, head_dim=K, v_head_dim=V, decay="channel", beta="head",
                        allow_neg_eigval=allow_neg_eigval, **_short_conv(t),
                        decay_low_rank=t.shape("f_proj.0.weight")[0], output_gate="sigmoid",
                        output_gate_rank=t.shape("g_proj.0.weight")[0], output_norm=True, qk_norm="l2",
                        norm_eps=norm_eps, gate_lower_bound=lower_bound, **overrides)
  return cfg, D


def kda_params(state_dict, cfg: RecurrentConfig, d_model: int, *, prefix: str = "") -> dict:
  """Nested NumPy params of `RecurrentMixer(cfg, d_model)` from the fla KimiDeltaAttention's state_dict; every
  tensor is used."""
  t = state_dict if isinstance(state_dict, Tensors) else Tensors(state_dict, prefix)
  H, HV, K, V, D = cfg.num_heads, cfg.HV, cfg.head_dim, cfg.V, d_model
  Rf, Rg = cfg.decay_low_rank, cfg.output_gate_rank
  p = {
      "q_proj": linear(t, "q_proj", D, H * K),
      "k_proj": linear(t, "k_proj", D, H * K),
      "v_proj": linear(t, "v_proj", D, HV * V),
      **_short_conv_params(t, cfg),
      # fla's dt_bias.view(HV, K) and f.view(..., HV, K) are our [HV * K] layout, value-head major.
      "f_a_proj": linear(t, "f_proj.0", D, Rf),
      "f_b_proj": linear(t, "f_proj.1", Rf, HV * K),
      "b_proj": linear(t, "b_proj", D, HV),
      "A_log": t.take("A_log", (HV,)),
      "dt_bias": t.take("dt_bias", (HV * K,)),
      "g_a_proj": linear(t, "g_proj.0", D, Rg),
      "g_b_proj": linear(t, "g_proj.1", Rg, HV * V, bias=True),
      "o_norm": {"weight": t.take("o_norm.weight", (V,))},
      "o_proj": linear(t, "o_proj", HV * V, D),
  }
  t.check_consumed()
  return p


def load_kda(state_dict, *, prefix: str = "", module: Optional[RecurrentMixer] = None, dtype=jnp.float32,
             rngs: Optional[nnx.Rngs] = None, **config) -> RecurrentMixer:
  """A `RecurrentMixer` holding the fla KimiDeltaAttention's weights (filled in place when `module` is given).

  state_dict: as `load_mixer`; prefix e.g. "model.layers.0.attn.". `config`: `kda_config`'s keywords.
  """
  t = Tensors(state_dict, prefix)
  cfg, d_model = kda_config(t, **config)
  module = target(module, lambda: RecurrentMixer(cfg, d_model, dtype=dtype, rngs=rngs or nnx.Rngs(0)), cfg, d_model)
  return assign(module, kda_params(t, cfg, d_model))


# Whole models: fla's GatedDeltaNetForCausalLM, its hybrids with standard attention layers included.

FLA_LAYOUT = causal_lm.Layout(embed="model.embeddings.", final_norm="model.norm.", layer="model.layers.{}.",
                              plus_one=False)


def _attention_spec(fla_config) -> Optional[dict]:
  """fla's `attn` field (one spec or a list) as one spec and its layers; the specs must agree but for layers."""
  attn = field(fla_config, "attn", None)
  if not attn:
    return None
  specs = [attn] if isinstance(attn, Mapping) else list(attn)
  settings = lambda s: {k: s.get(k, d) for k, d in (("num_heads", None), ("num_kv_heads", None),
                                                     ("qkv_bias", False), ("window_size", None),
                                                     ("rope_theta", 10000.0))}
  if any(settings(s) != settings(specs[0]) for s in specs):
    raise ValueError(f"fla_config.attn: attention layers with different settings are not supported "
                     f"(one AttentionConfig per model), got {specs}")
  return dict(settings(specs[0]), layers=sorted(i for s in specs for i in s["layers"]))


def mlp_hidden(fla_config) -> int:
  """fla's GatedMLP width: intermediate_size, else 2/3 * hidden_ratio * hidden_size rounded up to 256."""
  size = field(fla_config, "intermediate_size", None)
  if size is None:
    ratio = field(fla_config, "hidden_ratio", None)
    size = int(field(fla_config, "hidden_size") * (4 if ratio is None else ratio) * 2 / 3)  # fla: None means 4
    size = 256 * -(-size // 256)
  return size


def model_config(fla_config, **overrides) -> ModelConfig:
  """Our ModelConfig of an fla `GatedDeltaNetForCausalLM` from its `GatedDeltaNetConfig` or config.json dict.
  `overrides`: our RecurrentConfig fields fla has no counterpart for (method, chunk_size)."""
  for name in ("attnres_block_size",):
    if field(fla_config, name, None) is not None:
      raise ValueError(f"fla_config.{name}={field(fla_config, name)!r}: attention residuals are not supported")
  act = field(fla_config, "hidden_act", "swish")
  if act not in ("swish", "silu"):
    raise ValueError(f"fla_config.hidden_act={act!r}: our MLP is SwiGLU (swish)")
  gate_act = field(fla_config, "output_gate_activation", "swish")
  if gate_act not in GATES:
    raise ValueError(f"fla_config.output_gate_activation must be one of {tuple(GATES)}, got {gate_act!r}")
  D, L, H, K = (field(fla_config, n) for n in ("hidden_size", "num_hidden_layers", "num_heads", "head_dim"))
  conv = bool(field(fla_config, "use_short_conv", True))
  eps = float(field(fla_config, "norm_eps", 1e-6))
  rec = RecurrentConfig(num_heads=H, num_v_heads=field(fla_config, "num_v_heads", None), head_dim=K,
                        v_head_dim=int(K * field(fla_config, "expand_v", 2.0)), decay="head", beta="head",
                        allow_neg_eigval=bool(field(fla_config, "allow_neg_eigval", False)), short_conv=conv,
                        conv_size=field(fla_config, "conv_size", 4), silu_without_conv=not conv,
                        output_gate=GATES[gate_act] if field(fla_config, "use_gate", True) else "none",
                        output_norm=True, qk_norm="l2", norm_eps=eps, **overrides)
  spec = _attention_spec(fla_config)
  pattern, attention = "R" * L, AttentionConfig()
  if spec is not None:
    letter = "W" if spec["window_size"] else "A"
    pattern = "".join(letter if i in spec["layers"] else "R" for i in range(L))
    N = spec["num_heads"]
    attention = AttentionConfig(num_heads=N, num_kv_heads=spec["num_kv_heads"], head_dim=D // N,
                                rope_theta=float(spec["rope_theta"]), window=spec["window_size"] or 0,
                                proj_bias=bool(spec["qkv_bias"]))
  return ModelConfig(vocab_size=field(fla_config, "vocab_size"), d_model=D, num_layers=L, pattern=pattern,
                     recurrent=rec, attention=attention, mlp_hidden=mlp_hidden(fla_config),
                     tie_embeddings=bool(field(fla_config, "tie_word_embeddings", False)), norm_eps=eps)


def _attention_params(t: Tensors, cfg: ModelConfig) -> dict:
  """fla's standard `Attention`: q/k/v projections (biases with qkv_bias), o_proj without a bias (ours: zero)."""
  a, D = cfg.attention, cfg.d_model
  N, G, E = a.num_heads, a.KVH, a.head_dim
  p = {n: linear(t, n, D, rows, bias=a.proj_bias) for n, rows in (("q_proj", N * E), ("k_proj", G * E),
                                                                   ("v_proj", G * E))}
  p["o_proj"] = linear(t, "o_proj", N * E, D)
  if a.proj_bias:
    p["o_proj"]["bias"] = np.zeros((D,), np.float32)
  t.check_consumed()
  return p


def load_model(source, fla_config=None, **overrides) -> LanguageModel:
  """Our `LanguageModel` holding an fla `GatedDeltaNetForCausalLM` (hybrids with standard attention layers too).

  source: a checkpoint folder (safetensors with its config.json, as `save_pretrained` writes it), a safetensors
  file or index, or the model's `state_dict()`; fla_config: its `GatedDeltaNetConfig` or config.json dict
  (read from the folder when None). `overrides`: as `model_config`.
  """
  fla_config = causal_lm.read_config(source, fla_config)
  cfg = model_config(fla_config, **overrides)
  D = cfg.d_model

  def layer(parts, i):
    kind = cfg.layer_kinds[i]
    mixer = (mixer_params(parts.tensors("attn."), cfg.recurrent, D) if kind == "recurrent" else
             _attention_params(parts.tensors("attn."), cfg))
    return {"mixer_norm": causal_lm.norm_params(parts.tensors("attn_norm."), D, plus_one=False), "mixer": mixer,
            "mlp_norm": causal_lm.norm_params(parts.tensors("mlp_norm."), D, plus_one=False),
            "mlp": causal_lm.swiglu_params(parts.tensors("mlp."), D, cfg.mlp_hidden)}

  return causal_lm.load(source, cfg, FLA_LAYOUT, layer)


def _expand_v(K: int, V: int) -> float:
  """fla's expand_v for value heads of width V: fla (and `model_config`) take int(K * expand_v), which V / K
  rounded down can leave one short (K = 88, V = 120), so it is raised by ulps until the product reaches V."""
  ratio = V / K
  while int(K * ratio) < V:
    ratio = math.nextafter(ratio, math.inf)
  return ratio


def fla_config_dict(cfg: ModelConfig) -> dict:
  """The config.json of the fla `GatedDeltaNetForCausalLM` closest to `cfg` (`save_model` checks that it is
  exact)."""
  rec, att, kinds = cfg.recurrent, cfg.attention, cfg.layer_kinds
  out = dict(architectures=["GatedDeltaNetForCausalLM"], model_type="gated_deltanet", vocab_size=cfg.vocab_size,
             hidden_size=cfg.d_model, num_hidden_layers=cfg.num_layers, num_heads=rec.num_heads,
             num_v_heads=rec.HV, head_dim=rec.head_dim, expand_v=_expand_v(rec.head_dim, rec.V),
             use_gate=rec.output_gate != "none",
             output_gate_activation="sigmoid" if rec.output_gate == "sigmoid" else "swish",
             use_short_conv=rec.short_conv, conv_size=rec.conv_size, allow_neg_eigval=rec.allow_neg_eigval,
             norm_eps=cfg.norm_eps, hidden_act="swish",
             intermediate_size=cfg.mlp_hidden or hidden_size(cfg.d_model, cfg.mlp_ratio),
             tie_word_embeddings=cfg.tie_embeddings, torch_dtype="float32", attn=None)
  layers = [i for i, k in enumerate(kinds) if k != "recurrent"]
  if layers:
    out["attn"] = dict(layers=layers, num_heads=att.num_heads, num_kv_heads=att.KVH, qkv_bias=att.proj_bias,
                       window_size=att.window if "sliding_window" in kinds else None, rope_theta=att.rope_theta)
  return out


def save_model(model: LanguageModel, path) -> dict:
  """Write `model` as a checkpoint folder (model.safetensors in float32, config.json) that fla's
  `GatedDeltaNetForCausalLM.from_pretrained(path)` loads with the same logits; returns the config dict.

  Refused, naming the setting: what fla's model cannot hold (MoE layers, a recurrent layer other than fla's
  Gated DeltaNet, attention with an output gate, q/k norm, partial or scaled RoPE, a head dim other than
  d_model / num_heads, an o_proj bias, both global and sliding-window layers, ...).
  """
  model = causal_lm.unrolled(model)
  cfg = model.cfg
  config = fla_config_dict(cfg)
  causal_lm.check_representable(cfg, model_config(config), "fla's GatedDeltaNetForCausalLM")
  p = causal_lm.params(model)
  rec = cfg.recurrent
  tensors = causal_lm.common_tensors(model, p, FLA_LAYOUT)
  for i, kind in enumerate(cfg.layer_kinds):
    b, m = ("blocks", i), ("blocks", i, "mixer")
    sub = {"attn_norm.weight": p[b + ("mixer_norm", "weight")], "mlp_norm.weight": p[b + ("mlp_norm", "weight")],
           **causal_lm.swiglu_tensors(p, b + ("mlp",), "mlp.")}
    if kind == "recurrent":
      gate = ["g_proj"] if rec.output_gate != "none" else []
      names = ["q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "o_proj"] + gate
      for n in names:
        sub.update(causal_lm.linear_tensors(p, m + (n,), f"attn.{n}"))
      sub.update({"attn.A_log": p[m + ("A_log",)], "attn.dt_bias": p[m + ("dt_bias",)],
                  "attn.o_norm.weight": p[m + ("o_norm", "weight")]})
      if rec.short_conv:
        HK = rec.num_heads * rec.head_dim
        q, k, v = np.split(p[m + ("conv", "weight")], [HK, 2 * HK], axis=1)
        sub.update({f"attn.{n}_conv1d.weight": w.T[:, None, :] for n, w in (("q", q), ("k", k), ("v", v))})
    else:
      if np.any(p.get(m + ("o_proj", "bias"), 0.0)):
        raise ValueError(f"fla's attention has no o_proj bias: layer {i}'s attention.proj_bias is non-zero on o_proj")
      for n in ("q_proj", "k_proj", "v_proj"):
        sub.update(causal_lm.linear_tensors(p, m + (n,), f"attn.{n}"))
      sub["attn.o_proj.weight"] = p[m + ("o_proj", "kernel")].T
    tensors.update({FLA_LAYOUT.layer.format(i) + k: v for k, v in sub.items()})
  causal_lm.save(path, tensors, config)
  return config
