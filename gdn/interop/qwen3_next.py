"""Import Hugging Face transformers' Qwen3-Next layers: `Qwen3NextGatedDeltaNet` into `RecurrentMixer` and the
gated `Qwen3NextAttention` into `Attention`.

Gated DeltaNet (keys under e.g. "model.layers.0.linear_attn."):
  in_proj_qkvz [2*H*K + 2*HV*V, D] is grouped by q/k head: for each of the H heads, [q (K), k (K), v (G*V),
  z (G*V)] rows, G = HV // H; in_proj_ba [2*HV, D] likewise [b (G), a (G)] per q/k head. Value head i is
  v-group i // G, slot i % G, so value head i reads q/k head i // G, as in our op.
  conv1d [2*H*K + HV*V, 1, W] runs over [q | k | v] channels (our conv's order), then SiLU; no bias.
  beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias), q and k L2-normalised (eps 1e-6), q / sqrt(K).
  norm = RMSNormGated(V, rms_norm_eps): weight * RMSNorm(o) * silu(z) (a plain weight, not 1 + w); out_proj.
Gated attention (keys under e.g. "model.layers.3.self_attn."):
  q_proj [N*2E, D] gives per head [query (E), gate (E)], our Attention's layout; k_proj, v_proj [G*E, D];
  with attention_bias=True all four projections (o_proj too) have biases, our AttentionConfig.proj_bias;
  q_norm / k_norm are Qwen3NextRMSNorm, which scales by (1 + w): imported as our RMSNorm weight 1 + w (the same
  float32 number torch multiplies by). RoPE on the first int(E * partial_rotary_factor) dims, half-split pairs,
  plain or YaRN (`rope_fields`).
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdn.config import AttentionConfig, ModelConfig, MoEConfig, RecurrentConfig
from gdn.interop import causal_lm
from gdn.interop.state_dict import Tensors, assign, field, linear, target
from gdn.layers.attention import Attention
from gdn.layers.mlp import hidden_size
from gdn.layers.recurrent import RecurrentMixer
from gdn.model import LanguageModel


def gated_deltanet_config(hf_config, **overrides) -> tuple:
  """(RecurrentConfig, d_model) from a `Qwen3NextConfig` or its config.json dict. `overrides`: our fields that
  the source has no counterpart for (method, chunk_size)."""
  act = field(hf_config, "hidden_act", "silu")
  if act not in ("silu", "swish"):
    raise ValueError(f"hf_config.hidden_act={act!r}: the Gated DeltaNet's conv activation must be silu")
  cfg = RecurrentConfig(num_heads=field(hf_config, "linear_num_key_heads"),
                        num_v_heads=field(hf_config, "linear_num_value_heads"),
                        head_dim=field(hf_config, "linear_key_head_dim"),
                        v_head_dim=field(hf_config, "linear_value_head_dim"),
                        decay="head", beta="head", short_conv=True,
                        conv_size=field(hf_config, "linear_conv_kernel_dim"),
                        output_gate="silu", output_norm=True, qk_norm="l2", qkv_bias=False, out_bias=False,
                        norm_eps=float(field(hf_config, "rms_norm_eps")), **overrides)
  return cfg, field(hf_config, "hidden_size")


def gated_deltanet_params(state_dict, cfg: RecurrentConfig, d_model: int, *, prefix: str = "") -> dict:
  """Nested NumPy params of `RecurrentMixer(cfg, d_model)` from a `Qwen3NextGatedDeltaNet` state_dict."""
  t = state_dict if isinstance(state_dict, Tensors) else Tensors(state_dict, prefix)
  H, HV, K, V, W, D = cfg.num_heads, cfg.HV, cfg.head_dim, cfg.V, cfg.conv_size, d_model
  G = HV // H
  qkvz = t.take("in_proj_qkvz.weight", (2 * H * K + 2 * HV * V, D)).reshape(H, 2 * K + 2 * G * V, D)
  q, k, v, z = np.split(qkvz, [K, 2 * K, 2 * K + G * V], axis=1)
  ba = t.take("in_proj_ba.weight", (2 * HV, D)).reshape(H, 2 * G, D)
  b, a = ba[:, :G], ba[:, G:]
  kernel = lambda w: {"kernel": w.reshape(-1, D).T}  # [H, rows, D] -> [D, H * rows], head-major like torch's view
  p = {
      "q_proj": kernel(q),
      "k_proj": kernel(k),
      "v_proj": kernel(v),
      "g_proj": kernel(z),
      "b_proj": kernel(b),
      "a_proj": kernel(a),
      "conv": {"weight": t.take("conv1d.weight", (2 * H * K + HV * V, 1, W))[:, 0, :].T},
      "A_log": t.take("A_log", (HV,)),
      "dt_bias": t.take("dt_bias", (HV,)),
      "o_norm": {"weight": t.take("norm.weight", (V,))},
      "o_proj": linear(t, "out_proj", HV * V, D),
  }
  t.check_consumed()
  return p


def load_gated_deltanet(state_dict, hf_config, *, prefix: str = "", module: Optional[RecurrentMixer] = None,
                        dtype=jnp.float32, rngs: Optional[nnx.Rngs] = None, **overrides) -> RecurrentMixer:
  """A `RecurrentMixer` holding a `Qwen3NextGatedDeltaNet`'s weights (filled in place when `module` is given).

  state_dict: the layer's `state_dict()`, any mapping of names to tensors, or a safetensors file, sharded index
  or folder; prefix selects one layer of a model checkpoint (e.g. "model.layers.0.linear_attn.").
  """
  t = Tensors(state_dict, prefix)
  cfg, d_model = gated_deltanet_config(hf_config, **overrides)
  module = target(module, lambda: RecurrentMixer(cfg, d_model, dtype=dtype, rngs=rngs or nnx.Rngs(0)), cfg, d_model)
  return assign(module, gated_deltanet_params(t, cfg, d_model))


def rope_fields(hf_config) -> dict:
  """Our AttentionConfig's rope fields from a config: `rope_parameters` (transformers 5) or `rope_scaling`
  (config.json files, transformers 4), theta and partial_rotary_factor inside them or on the config. Types
  "default" and "yarn" are read; any other is refused by name."""
  rope = dict(field(hf_config, "rope_scaling", None) or {})
  rope.update(field(hf_config, "rope_parameters", None) or {})
  kind = rope.get("rope_type", rope.get("type", "default"))
  theta = rope.get("rope_theta", field(hf_config, "rope_theta", 10000.0))
  fraction = rope.get("partial_rotary_factor", field(hf_config, "partial_rotary_factor", 1.0))
  out = dict(rope_theta=float(theta), rope_fraction=float(fraction))
  if kind == "default":
    return out
  if kind != "yarn":
    raise ValueError(f"hf_config rope_type={kind!r}: our Attention implements 'default' and 'yarn' RoPE only")
  if rope.get("mscale") or rope.get("mscale_all_dim"):
    raise ValueError("hf_config rope mscale / mscale_all_dim (DeepSeek's YaRN magnitude) is not supported; "
                     "give attention_factor instead")
  original = rope.get("original_max_position_embeddings")
  if original is None:
    original = (field(hf_config, "original_max_position_embeddings", None)
                or field(hf_config, "max_position_embeddings"))
  factor = rope.get("factor") or field(hf_config, "max_position_embeddings") / original
  attention_factor = rope.get("attention_factor")
  return dict(out, rope_scaling="yarn", rope_factor=float(factor), rope_original_max_len=int(original),
              rope_beta_fast=float(rope.get("beta_fast") or 32.0), rope_beta_slow=float(rope.get("beta_slow") or 1.0),
              rope_attention_factor=None if attention_factor is None else float(attention_factor),
              rope_truncate=bool(rope.get("truncate", True)))


def attention_config(hf_config, **overrides) -> tuple:
  """(AttentionConfig, d_model, norm_eps) from a `Qwen3NextConfig` or its config.json dict; norm_eps is
  `Attention`'s constructor argument for the q/k norms. `overrides`: e.g. implementation."""
  N, D = field(hf_config, "num_attention_heads"), field(hf_config, "hidden_size")
  cfg = AttentionConfig(num_heads=N, num_kv_heads=field(hf_config, "num_key_value_heads", N),
                        head_dim=field(hf_config, "head_dim", None) or D // N, **rope_fields(hf_config),
                        output_gate="sigmoid", qk_norm=True,
                        proj_bias=bool(field(hf_config, "attention_bias", False)), **overrides)
  return cfg, D, float(field(hf_config, "rms_norm_eps"))


def attention_params(state_dict, cfg: AttentionConfig, d_model: int, *, prefix: str = "") -> dict:
  """Nested NumPy params of `Attention(cfg, d_model)` from a `Qwen3NextAttention` state_dict."""
  t = state_dict if isinstance(state_dict, Tensors) else Tensors(state_dict, prefix)
  N, G, E, D = cfg.num_heads, cfg.KVH, cfg.head_dim, d_model
  bias = cfg.proj_bias
  p = {
      # q_proj's bias follows its rows' per-head [query, gate] order, which is ours.
      "q_proj": linear(t, "q_proj", D, 2 * N * E, bias=bias),
      "k_proj": linear(t, "k_proj", D, G * E, bias=bias),
      "v_proj": linear(t, "v_proj", D, G * E, bias=bias),
      "o_proj": linear(t, "o_proj", N * E, D, bias=bias),
      # Qwen3NextRMSNorm multiplies by (1 + w) in float32; 1 + w is that same float32 number.
      "q_norm": {"weight": 1.0 + t.take("q_norm.weight", (E,))},
      "k_norm": {"weight": 1.0 + t.take("k_norm.weight", (E,))},
  }
  t.check_consumed()
  return p


def load_attention(state_dict, hf_config, *, prefix: str = "", module: Optional[Attention] = None, window: int = 0,
                   dtype=jnp.float32, rngs: Optional[nnx.Rngs] = None, **overrides) -> Attention:
  """An `Attention` holding a `Qwen3NextAttention`'s weights (filled in place when `module` is given).

  state_dict: as `load_gated_deltanet`; prefix e.g. "model.layers.3.self_attn.". window > 0 makes a sliding-window
  layer from the same weights (Qwen3-Next itself attends globally).
  """
  t = Tensors(state_dict, prefix)
  cfg, d_model, eps = attention_config(hf_config, **overrides)
  build = lambda: Attention(cfg, d_model, window=window, norm_eps=eps, dtype=dtype, rngs=rngs or nnx.Rngs(0))
  module = target(module, build, cfg, d_model)
  if module.q_norm.eps != eps:
    raise ValueError(f"module's q/k norm eps is {module.q_norm.eps}, hf_config.rms_norm_eps {eps}")
  return assign(module, attention_params(t, cfg, d_model))


# Whole models: transformers' Qwen3NextForCausalLM, dense or with sparse MoE MLPs.

QWEN_LAYOUT = causal_lm.Layout(embed="model.embed_tokens.", final_norm="model.norm.", layer="model.layers.{}.",
                               plus_one=True, ignore=("mtp.",))
LAYER_LETTERS = {"linear_attention": "R", "full_attention": "A"}


def layer_types(hf_config) -> list:
  """"linear_attention" / "full_attention" per layer: `layer_types`, else every full_attention_interval-th."""
  L = field(hf_config, "num_hidden_layers")
  types = field(hf_config, "layer_types", None)
  if not types:
    every = field(hf_config, "full_attention_interval", 4)
    types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(L)]
  bad = sorted(set(types) - set(LAYER_LETTERS))
  if bad or len(types) != L:
    raise ValueError(f"hf_config.layer_types must hold {L} of {tuple(LAYER_LETTERS)}, got {types}")
  return list(types)


def moe_layers(hf_config) -> list:
  """Whether each layer's MLP is the sparse MoE block, as Qwen3NextDecoderLayer decides."""
  L, E = field(hf_config, "num_hidden_layers"), field(hf_config, "num_experts", 0)
  step, dense = field(hf_config, "decoder_sparse_step", 1), set(field(hf_config, "mlp_only_layers", []) or [])
  return [E > 0 and i not in dense and (i + 1) % step == 0 for i in range(L)]


def model_config(hf_config, **overrides) -> ModelConfig:
  """Our ModelConfig of a `Qwen3NextForCausalLM` from its `Qwen3NextConfig` or config.json dict. `overrides`: our
  RecurrentConfig fields that transformers has no counterpart for (method, chunk_size)."""
  moe = moe_layers(hf_config)
  moe_cfg = MoEConfig()
  if any(moe):
    moe_cfg = MoEConfig(num_experts=field(hf_config, "num_experts"), top_k=field(hf_config, "num_experts_per_tok"),
                        hidden=field(hf_config, "moe_intermediate_size"),
                        shared_hidden=field(hf_config, "shared_expert_intermediate_size"), shared_gate=True,
                        norm_topk=bool(field(hf_config, "norm_topk_prob", True)),
                        aux_loss_coef=float(field(hf_config, "router_aux_loss_coef", 0.001)))
  L = field(hf_config, "num_hidden_layers")
  return ModelConfig(vocab_size=field(hf_config, "vocab_size"), d_model=field(hf_config, "hidden_size"),
                     num_layers=L, pattern="".join(LAYER_LETTERS[t] for t in layer_types(hf_config)),
                     recurrent=gated_deltanet_config(hf_config, **overrides)[0],
                     attention=attention_config(hf_config)[0], mlp_hidden=field(hf_config, "intermediate_size"),
                     mlp_pattern="".join("M" if m else "D" for m in moe), moe=moe_cfg,
                     tie_embeddings=bool(field(hf_config, "tie_word_embeddings", False)),
                     norm_eps=float(field(hf_config, "rms_norm_eps")))


def _experts(t: Tensors, E: int, D: int, I: int) -> dict:
  """Our stacked experts [E, D, I] / [E, I, D] from transformers' fused gate_up_proj [E, 2I, D] and down_proj
  [E, D, I], or from published checkpoints' per-expert experts.{e}.gate_proj / up_proj / down_proj."""
  if "experts.gate_up_proj" in t:
    gate_up = t.take("experts.gate_up_proj", (E, 2 * I, D))
    return {"gate_proj": gate_up[:, :I].transpose(0, 2, 1), "up_proj": gate_up[:, I:].transpose(0, 2, 1),
            "down_proj": t.take("experts.down_proj", (E, D, I)).transpose(0, 2, 1)}
  one = lambda name, n_in, n_out: np.stack([linear(t, f"experts.{e}.{name}", n_in, n_out)["kernel"] for e in range(E)])
  return {"gate_proj": one("gate_proj", D, I), "up_proj": one("up_proj", D, I), "down_proj": one("down_proj", I, D)}


def moe_params(t: Tensors, cfg: MoEConfig, d_model: int) -> dict:
  """Our MoE from a `Qwen3NextSparseMoeBlock` state_dict: router gate.weight [E, D], the experts, the shared
  expert and its gate shared_expert_gate.weight [1, D]."""
  E, D = cfg.num_experts, d_model
  p = {"router": linear(t, "gate", D, E), "experts": _experts(t, E, D, cfg.hidden),
       "shared_expert": causal_lm.swiglu_params(t, D, cfg.shared_hidden, prefix="shared_expert."),
       "shared_gate": linear(t, "shared_expert_gate", D, 1)}
  t.check_consumed()
  return p


def load_model(source, hf_config=None, **overrides) -> LanguageModel:
  """Our `LanguageModel` holding a `Qwen3NextForCausalLM` (dense or MoE; its multi-token-prediction "mtp." tensors,
  which the causal LM does not use, are skipped).

  source: a checkpoint folder (safetensors with its config.json), a safetensors file or index, or the model's
  `state_dict()`; hf_config: its `Qwen3NextConfig` or config.json dict (read from the folder when None).
  `overrides`: as `model_config`.
  """
  hf_config = causal_lm.read_config(source, hf_config)
  cfg = model_config(hf_config, **overrides)
  D = cfg.d_model

  def layer(parts, i):
    if cfg.layer_kinds[i] == "recurrent":
      mixer = gated_deltanet_params(parts.tensors("linear_attn."), cfg.recurrent, D)
    else:
      mixer = attention_params(parts.tensors("self_attn."), cfg.attention, D)
    mlp = (moe_params(parts.tensors("mlp."), cfg.moe, D) if cfg.mlp_kinds[i] == "moe" else
           causal_lm.swiglu_params(parts.tensors("mlp."), D, cfg.mlp_hidden))
    return {"mixer_norm": causal_lm.norm_params(parts.tensors("input_layernorm."), D, plus_one=True), "mixer": mixer,
            "mlp_norm": causal_lm.norm_params(parts.tensors("post_attention_layernorm."), D, plus_one=True),
            "mlp": mlp}

  return causal_lm.load(source, cfg, QWEN_LAYOUT, layer)


def hf_config_dict(cfg: ModelConfig) -> dict:
  """The config.json of the `Qwen3NextForCausalLM` closest to `cfg` (`save_model` checks that it is exact)."""
  rec, att, moe = cfg.recurrent, cfg.attention, cfg.moe
  kinds = cfg.layer_kinds
  out = dict(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", vocab_size=cfg.vocab_size,
             hidden_size=cfg.d_model, num_hidden_layers=cfg.num_layers, hidden_act="silu",
             intermediate_size=cfg.mlp_hidden or hidden_size(cfg.d_model, cfg.mlp_ratio), rms_norm_eps=cfg.norm_eps,
             tie_word_embeddings=cfg.tie_embeddings, torch_dtype="float32",
             layer_types=["linear_attention" if k == "recurrent" else "full_attention" for k in kinds],
             linear_num_key_heads=rec.num_heads, linear_num_value_heads=rec.HV, linear_key_head_dim=rec.head_dim,
             linear_value_head_dim=rec.V, linear_conv_kernel_dim=rec.conv_size,
             num_attention_heads=att.num_heads, num_key_value_heads=att.KVH, head_dim=att.head_dim,
             attention_bias=att.proj_bias, rope_theta=att.rope_theta, partial_rotary_factor=att.rope_fraction,
             rope_scaling=None, max_position_embeddings=32768)
  if att.rope_scaling == "yarn":
    out["rope_scaling"] = dict(rope_type="yarn", factor=att.rope_factor,
                               original_max_position_embeddings=att.rope_original_max_len,
                               beta_fast=att.rope_beta_fast, beta_slow=att.rope_beta_slow,
                               attention_factor=att.rope_attention_factor, truncate=att.rope_truncate)
    out["max_position_embeddings"] = int(att.rope_original_max_len * att.rope_factor)
  moe_layers = [i for i, k in enumerate(cfg.mlp_kinds) if k == "moe"]
  out.update(num_experts=moe.num_experts if moe_layers else 0, num_experts_per_tok=moe.top_k,
             moe_intermediate_size=moe.hidden, shared_expert_intermediate_size=moe.shared_hidden,
             norm_topk_prob=moe.norm_topk, router_aux_loss_coef=moe.aux_loss_coef, decoder_sparse_step=1,
             mlp_only_layers=[i for i in range(cfg.num_layers) if i not in moe_layers] if moe_layers else [])
  return out


def _gated_deltanet_tensors(p: dict, path: tuple, cfg: RecurrentConfig, D: int) -> dict:
  """The inverse of `gated_deltanet_params`: our separate projections regrouped by q/k head into
  in_proj_qkvz / in_proj_ba."""
  H, HV, K, V = cfg.num_heads, cfg.HV, cfg.head_dim, cfg.V
  G = HV // H
  w = lambda name, rows: p[path + (name, "kernel")].T.reshape(H, rows, D)  # [H, rows, D], head-major
  qkvz = np.concatenate([w("q_proj", K), w("k_proj", K), w("v_proj", G * V), w("g_proj", G * V)], axis=1)
  ba = np.concatenate([w("b_proj", G), w("a_proj", G)], axis=1)
  return {"in_proj_qkvz.weight": qkvz.reshape(-1, D), "in_proj_ba.weight": ba.reshape(-1, D),
          "conv1d.weight": p[path + ("conv", "weight")].T[:, None, :], "A_log": p[path + ("A_log",)],
          "dt_bias": p[path + ("dt_bias",)], "norm.weight": p[path + ("o_norm", "weight")],
          "out_proj.weight": p[path + ("o_proj", "kernel")].T}


def save_model(model: LanguageModel, path) -> dict:
  """Write `model` as a checkpoint folder (model.safetensors in float32, config.json) that
  `transformers.Qwen3NextForCausalLM.from_pretrained(path)` loads with the same logits; returns the config dict.

  Refused, naming the setting: what Qwen3-Next cannot hold (sliding-window layers, a recurrent or attention
  layer other than Qwen3-Next's, MoE without the gated shared expert, norm epsilons that differ, ...).
  """
  model = causal_lm.unrolled(model)
  cfg = model.cfg
  if "moe" in cfg.mlp_kinds and not (cfg.moe.shared_hidden and cfg.moe.shared_gate):
    raise ValueError("Qwen3-Next's MoE block always has a gated shared expert: this model's moe.shared_hidden="
                     f"{cfg.moe.shared_hidden}, moe.shared_gate={cfg.moe.shared_gate}")
  config = hf_config_dict(cfg)
  causal_lm.check_representable(cfg, model_config(config), "Qwen3NextForCausalLM")
  p, D = causal_lm.params(model), cfg.d_model
  tensors = causal_lm.common_tensors(model, p, QWEN_LAYOUT)
  for i, (kind, mlp) in enumerate(zip(cfg.layer_kinds, cfg.mlp_kinds)):
    b, pre = ("blocks", i), QWEN_LAYOUT.layer.format(i)
    sub = {"input_layernorm.weight": p[b + ("mixer_norm", "weight")] - 1.0,
           "post_attention_layernorm.weight": p[b + ("mlp_norm", "weight")] - 1.0}
    if kind == "recurrent":
      mixer = _gated_deltanet_tensors(p, b + ("mixer",), cfg.recurrent, D)
      sub.update({f"linear_attn.{k}": v for k, v in mixer.items()})
    else:
      for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
        sub.update(causal_lm.linear_tensors(p, b + ("mixer", n), f"self_attn.{n}"))
      sub.update({f"self_attn.{n}.weight": p[b + ("mixer", n, "weight")] - 1.0 for n in ("q_norm", "k_norm")})
    if mlp == "moe":
      e = b + ("mlp", "experts")
      sub.update(causal_lm.linear_tensors(p, b + ("mlp", "router"), "mlp.gate"))
      sub.update(causal_lm.linear_tensors(p, b + ("mlp", "shared_gate"), "mlp.shared_expert_gate"))
      sub.update(causal_lm.swiglu_tensors(p, b + ("mlp", "shared_expert"), "mlp.shared_expert."))
      for j in range(cfg.moe.num_experts):  # the published per-expert form, which transformers fuses on load
        sub.update({f"mlp.experts.{j}.{n}.weight": p[e + (n,)][j].T for n in ("gate_proj", "up_proj", "down_proj")})
    else:
      sub.update(causal_lm.swiglu_tensors(p, b + ("mlp",), "mlp."))
    tensors.update({pre + k: v for k, v in sub.items()})
  causal_lm.save(path, tensors, config)
  return config
