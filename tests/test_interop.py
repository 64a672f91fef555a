"""Weight import from PyTorch: build the torch layer with random weights, import, compare outputs on one input.

Needs the interop extra (`pip install -e ".[interop]"`); torch tests skip without it. Run them all with
`python -m pytest -m interop`. Each comparison is float32, max |ours - theirs| / max |theirs| <= 1e-5.
"""

import dataclasses
import glob
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdn.config import ModelConfig, recurrent_preset
from gdn.interop import fla as fla_interop
from gdn.interop import qwen3_next as qwen_interop
from gdn.interop import seed
from gdn.interop.state_dict import Tensors, read_safetensors
from gdn.layers.recurrent import RecurrentMixer
from gdn.model import LanguageModel

TOL = 1e-5
# The checks are math, not XLA's fusions: fewer optimisations compile faster (conftest.py).
pytestmark = pytest.mark.usefixtures("fast_compile")
SEED_GLOB = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "seeds", "000_*.txt")


@pytest.fixture
def torch():
  return pytest.importorskip("torch")


def rel_err(ours, theirs) -> float:
  ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs.detach().numpy(), np.float64)
  assert ours.shape == theirs.shape
  return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


def randomize(torch, module, scale=0.3):
  """Move every parameter off its init (norm weights of one, dt_bias of one, zero biases would hide a swap)."""
  with torch.no_grad():
    for p in module.parameters():
      p.add_(scale * torch.randn_like(p))
  return module.eval()


@nnx.jit
def _forward(module, x):
  return module(x)[0]


_logits = nnx.jit(lambda model, tokens: model(tokens))  # a whole model: one compile, not its many eager ops


def run(module, x):
  """Our layer on a torch input, jitted: one compile is cheaper than the chunk path's many eager ops."""
  return _forward(module, jnp.asarray(x.numpy()))


# The seed class, from the seed text.


def seed_class():
  """The seed's GatedDeltaNet, exec'd from the code listing in section 6.6.4 of the seed text."""
  paths = sorted(glob.glob(SEED_GLOB))
  if not paths:
    pytest.skip(f"seed text not found at {SEED_GLOB} (shared/ beside the repository)")
  text = open(paths[0], encoding="utf-8").read()
  end_marker = "return self.out_proj(context)"
  start, end = text.find("import torch\n"), text.find(end_marker)
  assert 0 <= start < end, "the seed text no longer holds the GatedDeltaNet listing"
  namespace = {}
  exec(compile(text[start:end + len(end_marker)] + "\n", paths[0], "exec"), namespace)
  return namespace["GatedDeltaNet"]


@pytest.mark.interop
@pytest.mark.parametrize("qkv_bias,T", [(False, 1), (False, 37), (True, 70)])
def test_seed_class(torch, qkv_bias, T):
  torch.manual_seed(T)
  theirs = randomize(torch, seed_class()(48, 48, 4, dropout=0.1, qkv_bias=qkv_bias))
  x = torch.randn(2, T, 48)
  with torch.no_grad():
    y = theirs(x)
  ours = seed.load_mixer(theirs.state_dict(), dropout=0.1)
  assert ours.cfg == recurrent_preset("seed", num_heads=4, head_dim=12, qkv_bias=qkv_bias, dropout=0.1)
  ours.eval()
  assert rel_err(run(ours, x), y) <= TOL


@pytest.mark.interop
def test_seed_class_into_an_existing_module_and_from_safetensors(torch, tmp_path):
  safetensors_torch = pytest.importorskip("safetensors.torch")
  torch.manual_seed(1)
  theirs = randomize(torch, seed_class()(32, 32, 2))
  # A checkpoint with the layer under a prefix, stored in bfloat16 as checkpoints usually are.
  path = tmp_path / "seed.safetensors"
  safetensors_torch.save_file({f"blocks.1.mixer.{k}": v.to(torch.bfloat16) for k, v in theirs.state_dict().items()},
                              str(path))
  cfg, d_model = seed.mixer_config(theirs.state_dict())
  module = RecurrentMixer(cfg, d_model, rngs=nnx.Rngs(3))
  assert seed.load_mixer(str(path), prefix="blocks.1.mixer.", module=module) is module
  with torch.no_grad():
    theirs.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in theirs.state_dict().items()})
    x = torch.randn(1, 19, 32)
    y = theirs(x)
  assert rel_err(run(module, x), y) <= TOL


# fla's GatedDeltaNet layer.


@pytest.fixture
def fla_on_cpu(torch, monkeypatch):
  """fla's norms and short convolution on CPU: the pieces its GatedDeltaNet and KimiDeltaAttention layers share.

  fla's kernels are Triton, which has no CPU backend; the layers' own code (projections, the order of the pieces,
  the keyword flags they pass) still runs. The gated norm goes through fla's `rms_norm_ref`, the causal conv (its
  bias and SiLU included) through torch's conv1d with W-1 zeros of left padding. Returns the conv, for the
  layer-level names that import it.
  """
  pytest.importorskip("fla", exc_type=ImportError)  # fla imports Triton at import time
  import torch.nn.functional as F
  from fla.modules import FusedRMSNormGated, RMSNorm
  from fla.modules.causal_conv1d import ops as conv_ops
  from fla.modules.norm.layernorm import rms_norm_ref
  from fla.modules.norm.layernorm_gated import rms_norm_ref as gated_rms_norm_ref

  def conv(x, weight, bias=None, residual=None, activation=None, initial_state=None, output_final_state=False,
           **unused):
    assert residual is None and initial_state is None and not output_final_state
    W = weight.shape[-1]
    y = F.conv1d(F.pad(x.transpose(1, 2), (W - 1, 0)), weight[:, None], bias, groups=weight.shape[0])
    y = y.transpose(1, 2)
    return (F.silu(y) if activation in ("silu", "swish") else y), None

  def gated_norm(self, x, g, residual=None, prenorm=False, residual_in_fp32=False):
    assert residual is None and not prenorm
    if self.activation in ("swish", "silu"):
      return gated_rms_norm_ref(x, self.weight, self.bias, z=g, eps=self.eps)
    return rms_norm_ref(x, self.weight, self.bias, eps=self.eps, upcast=True) * g.float().sigmoid()

  def norm(self, x, residual=None, prenorm=False, residual_in_fp32=False):
    assert residual is None and not prenorm
    return rms_norm_ref(x, self.weight, self.bias, eps=self.eps, upcast=True)

  monkeypatch.setattr(conv_ops, "causal_conv1d", conv)  # ShortConvolution.forward's call over a whole sequence
  monkeypatch.setattr(FusedRMSNormGated, "forward", gated_norm)
  monkeypatch.setattr(RMSNorm, "forward", norm)
  return conv


def in_kernel_steps(torch, q, k, beta, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval):
  """The steps fla's delta-rule kernels take on request, as they document them: q/k L2 norm (eps 1e-6) and
  beta = sigmoid(b) (x2 with allow_neg_eigval)."""
  if use_qk_l2norm_in_kernel:
    q, k = (x / torch.sqrt((x.float() ** 2).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
  if use_beta_sigmoid_in_kernel:
    beta = beta.float().sigmoid() * (2.0 if allow_neg_eigval else 1.0)
  return q, k, beta


@pytest.fixture
def fla_layer_on_cpu(torch, monkeypatch, fla_on_cpu):
  """fla's GatedDeltaNet class with its Triton kernels replaced by fla's own pure-torch references.

  The delta rule goes through fla's `naive_recurrent_gated_delta_rule` and `naive_gdn_gate`, after the steps of
  `in_kernel_steps`, value head i reading q/k head i // (HV // H); norms and conv as `fla_on_cpu`.
  """
  from fla.layers import gated_deltanet as layer_module
  from fla.ops.gated_delta_rule.gate import naive_gdn_gate
  from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

  def delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                 use_gate_in_kernel=False, A_log=None, dt_bias=None, cu_seqlens=None, **unused):
    assert cu_seqlens is None and initial_state is None
    q, k, beta = in_kernel_steps(torch, q, k, beta, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel,
                                 allow_neg_eigval)
    if use_gate_in_kernel:
      g = naive_gdn_gate(g, A_log, dt_bias)
    G = v.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(G, dim=2), k.repeat_interleave(G, dim=2)
    return naive_recurrent_gated_delta_rule(q, k, v, beta, g, scale=scale, output_final_state=output_final_state)

  monkeypatch.setattr(layer_module, "chunk_gated_delta_rule", delta_rule)
  monkeypatch.setattr(layer_module, "fused_recurrent_gated_delta_rule", delta_rule)
  monkeypatch.setattr(layer_module, "causal_conv1d", fla_on_cpu)  # the layer's fused [q | k | v] conv
  return layer_module.GatedDeltaNet


FLA_CASES = {
    "paper": dict(num_heads=2, head_dim=16, expand_v=2.0),
    "grouped_values": dict(num_heads=2, num_v_heads=4, head_dim=16, expand_v=1.5),
    "neg_eigval_sigmoid_gate": dict(num_heads=4, head_dim=8, expand_v=1.0, allow_neg_eigval=True,
                                    output_gate_activation="sigmoid", norm_eps=1e-6, conv_size=3),
    "no_gate": dict(num_heads=2, head_dim=16, expand_v=1.0, use_gate=False),
    "conv_bias": dict(num_heads=2, num_v_heads=4, head_dim=8, expand_v=2.0, conv_bias=True),
    "no_short_conv": dict(num_heads=2, head_dim=16, expand_v=1.0, use_short_conv=False),
}


@pytest.mark.interop
@pytest.mark.filterwarnings("ignore:ShortConvolution is crucial")  # fla's warning for use_short_conv=False
@pytest.mark.parametrize("case", sorted(FLA_CASES))
def test_fla_gated_deltanet(torch, fla_layer_on_cpu, case):
  kw = FLA_CASES[case]
  torch.manual_seed(0)
  theirs = randomize(torch, fla_layer_on_cpu(hidden_size=64, **kw))
  x = torch.randn(2, 45, 64)
  with torch.no_grad():
    y, _, _ = theirs(x)
  config = {k: kw[k] for k in ("allow_neg_eigval", "output_gate_activation", "norm_eps") if k in kw}
  ours = fla_interop.load_mixer(theirs.state_dict(), num_heads=kw["num_heads"], **config)
  assert (ours.cfg.HV, ours.cfg.V) == (theirs.num_v_heads, theirs.head_v_dim)
  assert (ours.cfg.short_conv, ours.cfg.conv_bias) == (theirs.use_short_conv, kw.get("conv_bias", False))
  assert rel_err(run(ours, x), y) <= TOL


@pytest.mark.interop
def test_fla_model_config_and_prefix(torch, fla_layer_on_cpu):
  torch.manual_seed(2)
  theirs = randomize(torch, fla_layer_on_cpu(hidden_size=32, num_heads=2, head_dim=8, expand_v=2.0, norm_eps=1e-6))
  fla_config = {"num_heads": 2, "head_dim": 8, "norm_eps": 1e-6, "allow_neg_eigval": False}  # a config.json
  sd = {f"model.layers.0.attn.{k}": v for k, v in theirs.state_dict().items()}
  sd["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)  # another module's tensor: not ours to take
  ours = fla_interop.load_mixer(sd, prefix="model.layers.0.attn.", fla_config=fla_config, method="recurrent")
  x = torch.randn(1, 9, 32)
  with torch.no_grad():
    y, _, _ = theirs(x)
  assert rel_err(run(ours, x), y) <= TOL


@pytest.fixture
def fla_model_on_cpu(torch, monkeypatch, fla_layer_on_cpu):
  """fla's GatedDeltaNetForCausalLM on CPU: its GatedDeltaNet layers as `fla_layer_on_cpu`; its standard attention
  through torch's softmax attention in place of flash-attn (causal, GQA, the (window - 1, 0) window), fla's
  `rotary_embedding_ref` for RoPE and SiLU(gate) * up for the MLP (fla's configs with fuse_norm / fuse_swiglu off
  take torch's RMSNorm and this unfused path)."""
  import torch.nn.functional as F
  from fla.layers import attn as attn_module
  from fla.modules import mlp as mlp_module
  from fla.modules.rotary import ops as rotary_ops

  def flash_attn_func(q, k, v, causal=True, window_size=(-1, -1), **unused):
    assert causal
    T, G = q.shape[1], q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(G, dim=2), v.repeat_interleave(G, dim=2)
    i = torch.arange(T)
    ok = i[None, :] <= i[:, None]
    if window_size[0] >= 0:
      ok &= i[:, None] - i[None, :] <= window_size[0]
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=ok)
    return o.transpose(1, 2)

  def rotary(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None, **unused):
    assert cu_seqlens is None
    T = x.shape[1]
    return rotary_ops.rotary_embedding_ref(x, cos[seqlen_offsets:seqlen_offsets + T],
                                           sin[seqlen_offsets:seqlen_offsets + T], interleaved)

  monkeypatch.setattr(attn_module, "flash_attn_func", flash_attn_func)
  monkeypatch.setattr(rotary_ops, "rotary_embedding", rotary)
  monkeypatch.setattr(mlp_module, "swiglu", lambda gate, y: F.silu(gate) * y)
  from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM
  return GatedDeltaNetConfig, GatedDeltaNetForCausalLM


def greedy_torch(torch, theirs, prompt, n):
  """Greedy decoding of the torch model by full forwards (no attention mask, which fla would turn into packed
  sequences, and no cache, which needs its Triton decoding kernels)."""
  tokens = torch.as_tensor(np.asarray(prompt))
  with torch.no_grad():
    for _ in range(n):
      nxt = theirs(tokens, use_cache=False).logits[:, -1].argmax(-1)
      tokens = torch.cat([tokens, nxt[:, None]], dim=1)
  return tokens.numpy()


def check_model(torch, theirs, ours, vocab, T=13, new_tokens=6):
  """Logits equal on random tokens; greedy continuations equal token for token."""
  from gdn.generate import generate

  tokens = np.random.default_rng(T).integers(0, vocab, size=(2, T))
  with torch.no_grad():
    y = theirs(torch.as_tensor(tokens), use_cache=False).logits
  assert rel_err(_logits(ours, jnp.asarray(tokens)), y) <= TOL
  out = generate(ours, jnp.asarray(tokens[:, :5]), new_tokens, rng=None, temperature=0.0)
  np.testing.assert_array_equal(np.asarray(out), greedy_torch(torch, theirs, tokens[:, :5], new_tokens))


FLA_MODELS = {
    "hybrid": dict(num_heads=2, num_v_heads=4, head_dim=8, expand_v=1.0, num_hidden_layers=3, hidden_ratio=2,
                   attn={"layers": [1], "num_heads": 4, "num_kv_heads": 2, "rope_theta": 5e4}),
    "tied_window_no_gate": dict(num_heads=2, head_dim=8, num_hidden_layers=3, use_gate=False, intermediate_size=40,
                                tie_word_embeddings=True, attn=[{"layers": [0], "num_heads": 2, "window_size": 4},
                                                                {"layers": [2], "num_heads": 2, "window_size": 4}]),
}


@pytest.mark.interop
@pytest.mark.parametrize("case", sorted(FLA_MODELS))
def test_fla_causal_lm(torch, fla_model_on_cpu, tmp_path, case):
  config_class, model_class = fla_model_on_cpu
  hf_config = config_class(hidden_size=32, vocab_size=50, fuse_norm=False, fuse_swiglu=False, norm_eps=1e-6,
                           **FLA_MODELS[case])
  torch.manual_seed(3)
  theirs = randomize(torch, model_class(hf_config))
  theirs.save_pretrained(tmp_path)  # safetensors and config.json, as a published checkpoint
  ours = fla_interop.load_model(str(tmp_path))
  assert ours.cfg.pattern == "".join("A" if "Attention" == type(l.attn).__name__ else "R" for l in theirs.model.layers
                                     ).replace("A", "W" if "window" in case else "A")
  check_model(torch, theirs, ours, 50)
  same_checkpoint(fla_interop.save_model(ours, tmp_path / "back"), tmp_path, tmp_path / "back")


@pytest.mark.interop
def test_fla_export(torch, fla_model_on_cpu, tmp_path):
  """A gdn model (a grouped-value hybrid with GQA attention, built here) saved for fla, which loads it with our
  logits; what fla cannot hold is refused by name."""
  _, model_class = fla_model_on_cpu
  cfg = fla_interop.model_config(dict(FLA_MODELS["hybrid"], hidden_size=32, vocab_size=50, norm_eps=1e-6))
  ours = perturbed(LanguageModel(cfg, rngs=nnx.Rngs(4)))
  fla_interop.save_model(ours, tmp_path)
  theirs = model_class.from_pretrained(tmp_path, fuse_norm=False, fuse_swiglu=False).eval()
  check_model(torch, theirs, ours, 50)
  refused = {"attention.output_gate": dict(attention=dataclasses.replace(cfg.attention, output_gate="sigmoid")),
             "mlp_pattern": dict(mlp_pattern="M"),
             "recurrent.beta": dict(recurrent=dataclasses.replace(cfg.recurrent, beta="channel"))}
  for setting, change in refused.items():
    with pytest.raises(ValueError, match=setting):
      fla_interop.save_model(LanguageModel(dataclasses.replace(cfg, **change), rngs=nnx.Rngs(0)), tmp_path / "no")


# fla's KimiDeltaAttention layer.


@pytest.fixture
def fla_kda_on_cpu(torch, monkeypatch, fla_on_cpu):
  """fla's KimiDeltaAttention class with its Triton kernels replaced by fla's own pure-torch references: the delta
  rule through `naive_recurrent_kda` (grouped value heads included) and its gate through `naive_kda_gate`, after
  the steps of `in_kernel_steps`; norms and conv as `fla_on_cpu`."""
  from fla.layers import kda as layer_module
  from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate
  from fla.ops.kda.naive import naive_recurrent_kda

  def kda_rule(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
               allow_neg_eigval=False, lower_bound=None, cu_seqlens=None, **unused):
    assert cu_seqlens is None and initial_state is None
    q, k, beta = in_kernel_steps(torch, q, k, beta, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel,
                                 allow_neg_eigval)
    if use_gate_in_kernel:
      g = (naive_kda_gate(g, A_log, dt_bias) if lower_bound is None
           else naive_kda_lowerbound_gate(g, A_log, dt_bias, lower_bound))
    return naive_recurrent_kda(q, k, v, g, beta, scale=scale, output_final_state=output_final_state)

  monkeypatch.setattr(layer_module, "chunk_kda", kda_rule)
  monkeypatch.setattr(layer_module, "fused_recurrent_kda", kda_rule)
  return layer_module.KimiDeltaAttention


KDA_CASES = {
    "kda": dict(num_heads=2, head_dim=16, expand_v=1.0),
    "grouped_values_conv_bias_neg_eigval": dict(num_heads=2, num_v_heads=4, head_dim=8, expand_v=1.5,
                                                conv_bias=True, allow_neg_eigval=True, conv_size=3, norm_eps=1e-6),
    "no_short_conv": dict(num_heads=4, head_dim=8, expand_v=2.0, use_short_conv=False),
    "bounded_gate": dict(num_heads=2, head_dim=16, expand_v=1.0, lower_bound=-5.0),  # fla's safe_gate's gate
}


@pytest.mark.interop
@pytest.mark.parametrize("case", sorted(KDA_CASES))
def test_fla_kimi_delta_attention(torch, fla_kda_on_cpu, case):
  kw = KDA_CASES[case]
  torch.manual_seed(1)
  theirs = randomize(torch, fla_kda_on_cpu(hidden_size=64, **kw))
  x = torch.randn(2, 45, 64)
  with torch.no_grad():
    y, _, _ = theirs(x)
  config = {k: kw[k] for k in ("allow_neg_eigval", "norm_eps", "lower_bound") if k in kw}
  ours = fla_interop.load_kda(theirs.state_dict(), **config)
  assert (ours.cfg.num_heads, ours.cfg.HV, ours.cfg.head_dim, ours.cfg.V) == (
      theirs.num_heads, theirs.num_v_heads, theirs.head_k_dim, theirs.head_v_dim)
  assert ours.cfg.decay_low_rank == ours.cfg.output_gate_rank == theirs.head_v_dim
  assert rel_err(run(ours, x), y) <= TOL


@pytest.mark.interop
def test_fla_kda_from_model_config_and_prefix(torch, fla_kda_on_cpu):
  torch.manual_seed(4)
  theirs = randomize(torch, fla_kda_on_cpu(hidden_size=32, num_heads=2, head_dim=8, norm_eps=1e-6,
                                           allow_neg_eigval=True))
  fla_config = {"num_heads": 2, "head_dim": 8, "norm_eps": 1e-6, "allow_neg_eigval": True, "lower_bound": None}
  sd = {f"model.layers.2.attn.{k}": v for k, v in theirs.state_dict().items()}
  ours = fla_interop.load_kda(sd, prefix="model.layers.2.attn.", fla_config=fla_config, method="chunk",
                              chunk_size=16)
  x = torch.randn(1, 37, 32)
  with torch.no_grad():
    y, _, _ = theirs(x)
  assert rel_err(run(ours, x), y) <= TOL and ours.cfg.gate_lower_bound is None
  bounded = fla_interop.load_kda(sd, prefix="model.layers.2.attn.", fla_config={**fla_config, "lower_bound": -5.0})
  assert bounded.cfg.gate_lower_bound == -5.0
  with pytest.raises(ValueError, match="gate_lower_bound must be in"):
    fla_interop.load_kda(sd, prefix="model.layers.2.attn.", fla_config={**fla_config, "lower_bound": -8.0})


# Hugging Face transformers' Qwen3-Next.


@pytest.fixture
def hf_qwen3_next(torch, monkeypatch):
  """transformers' Qwen3-Next modeling module, on its own pure-torch delta rule.

  With fla installed, transformers routes the delta rule to fla's Triton kernels, which need a GPU; the
  decorated functions keep transformers' torch implementation as `__wrapped__`.
  """
  modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
  for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
    fn = getattr(modeling, name)
    monkeypatch.setattr(modeling, name, getattr(fn, "__wrapped__", fn))
  return modeling


def qwen3_next_config(**kw):
  from transformers import Qwen3NextConfig

  fields = dict(hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=24, linear_conv_kernel_dim=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, num_hidden_layers=4, vocab_size=32, intermediate_size=64, num_experts=0,
                rms_norm_eps=1e-6)
  config = Qwen3NextConfig(**{**fields, **kw})
  config._attn_implementation = "eager"  # the plain softmax path, which takes the explicit causal mask below
  return config


@pytest.mark.interop
@pytest.mark.parametrize("heads,T", [((2, 4), 45), ((2, 2), 70), ((1, 3), 8)])
def test_qwen3_next_gated_deltanet(torch, hf_qwen3_next, heads, T):
  hf_config = qwen3_next_config(linear_num_key_heads=heads[0], linear_num_value_heads=heads[1])
  torch.manual_seed(T)
  theirs = randomize(torch, hf_qwen3_next.Qwen3NextGatedDeltaNet(hf_config, layer_idx=0))
  x = torch.randn(2, T, 64)
  with torch.no_grad():
    y = theirs(x)
  ours = qwen_interop.load_gated_deltanet(theirs.state_dict(), hf_config)
  assert (ours.cfg.num_heads, ours.cfg.HV, ours.cfg.V) == (heads[0], heads[1], 24)
  assert rel_err(run(ours, x), y) <= TOL


def hf_attention(torch, modeling, theirs, hf_config, x):
  B, T, _ = x.shape
  cos_sin = modeling.Qwen3NextRotaryEmbedding(hf_config)(x, torch.arange(T)[None].expand(B, T))
  causal = torch.full((T, T), float("-inf")).triu(1)[None, None]
  with torch.no_grad():
    return theirs(x, cos_sin, causal)[0]


@pytest.mark.interop
@pytest.mark.parametrize("kw", [dict(), dict(num_key_value_heads=4, partial_rotary_factor=1.0, rope_theta=1e6),
                                dict(num_key_value_heads=1, head_dim=8), dict(attention_bias=True)])
def test_qwen3_next_gated_attention(torch, hf_qwen3_next, kw):
  hf_config = qwen3_next_config(**kw)
  torch.manual_seed(len(kw))
  theirs = randomize(torch, hf_qwen3_next.Qwen3NextAttention(hf_config, layer_idx=3))
  x = torch.randn(2, 23, 64)
  y = hf_attention(torch, hf_qwen3_next, theirs, hf_config, x)
  ours = qwen_interop.load_attention(theirs.state_dict(), hf_config)
  assert ours.cfg.output_gate == "sigmoid" and ours.cfg.qk_norm
  assert ours.cfg.proj_bias == kw.get("attention_bias", False) == (ours.o_proj.bias is not None)
  assert ours.rot_dim == int(ours.cfg.head_dim * kw.get("partial_rotary_factor", 0.25))
  assert rel_err(run(ours, x), y) <= TOL


YARN = [dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=262144),  # Qwen3-Next's published form
        dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=64, beta_fast=16, beta_slow=2),
        dict(type="yarn", factor=2.0, original_max_position_embeddings=32, attention_factor=1.3, truncate=False)]


@pytest.mark.interop
@pytest.mark.parametrize("rope", YARN)
def test_qwen3_next_yarn_from_config_json_rope_scaling(torch, hf_qwen3_next, rope):
  """config.json keeps YaRN under "rope_scaling" (theta beside it); transformers 5 reads it as rope_parameters."""
  config_json = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                     rope_theta=1e6 if rope["original_max_position_embeddings"] > 1000 else 1e4,
                     partial_rotary_factor=0.5, rope_scaling=rope)
  ours = qwen_interop.attention_config(config_json)[0]
  assert ours.rope_scaling == "yarn" and ours.rope_factor == rope["factor"]
  hf_rope = {k: v for k, v in rope.items() if k != "type"}
  hf_config = qwen3_next_config(rope_parameters=dict(hf_rope, rope_type="yarn", rope_theta=config_json["rope_theta"],
                                                     partial_rotary_factor=0.5))
  torch.manual_seed(7)
  theirs = randomize(torch, hf_qwen3_next.Qwen3NextAttention(hf_config, layer_idx=3))
  x = torch.randn(2, 40, 64)
  y = hf_attention(torch, hf_qwen3_next, theirs, hf_config, x)
  assert rel_err(run(qwen_interop.load_attention(theirs.state_dict(), config_json), x), y) <= TOL
  plain = qwen_interop.load_attention(theirs.state_dict(), {**config_json, "rope_scaling": None})
  assert rel_err(run(plain, x), y) > 1e-3  # the scaling matters at these sizes


@pytest.mark.interop
def test_qwen3_next_from_a_sharded_checkpoint(torch, hf_qwen3_next, tmp_path):
  """A decoder stack's layers from a sharded safetensors checkpoint, read through its index as from_pretrained
  would write it, and from the config.json dict."""
  safetensors_torch = pytest.importorskip("safetensors.torch")
  hf_config = qwen3_next_config()
  torch.manual_seed(5)
  gdn = randomize(torch, hf_qwen3_next.Qwen3NextGatedDeltaNet(hf_config, layer_idx=0))
  att = randomize(torch, hf_qwen3_next.Qwen3NextAttention(hf_config, layer_idx=3))
  shards = {"model-00001-of-00002.safetensors": {f"model.layers.0.linear_attn.{k}": v
                                                 for k, v in gdn.state_dict().items()},
            "model-00002-of-00002.safetensors": {f"model.layers.3.self_attn.{k}": v
                                                 for k, v in att.state_dict().items()}}
  weight_map = {}
  for name, tensors in shards.items():
    safetensors_torch.save_file(tensors, str(tmp_path / name))
    weight_map.update(dict.fromkeys(tensors, name))
  (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
  config_json = hf_config.to_dict()
  x = torch.randn(1, 30, 64)
  with torch.no_grad():
    y_gdn = gdn(x)
  ours_gdn = qwen_interop.load_gated_deltanet(str(tmp_path), config_json, prefix="model.layers.0.linear_attn.")
  ours_att = qwen_interop.load_attention(str(tmp_path), config_json, prefix="model.layers.3.self_attn.")
  assert rel_err(run(ours_gdn, x), y_gdn) <= TOL
  assert rel_err(run(ours_att, x), hf_attention(torch, hf_qwen3_next, att, hf_config, x)) <= TOL


QWEN_MODELS = {
    "moe_yarn": dict(num_hidden_layers=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                     shared_expert_intermediate_size=24, mlp_only_layers=[1],
                     rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=8,
                                          rope_theta=1e4, partial_rotary_factor=0.5)),
    "tied_moe_no_renorm": dict(num_hidden_layers=2, full_attention_interval=2, tie_word_embeddings=True, num_experts=3,
                               num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=8,
                               norm_topk_prob=False, decoder_sparse_step=2),
}


@pytest.mark.interop
@pytest.mark.parametrize("case", sorted(QWEN_MODELS))
def test_qwen3_next_causal_lm(torch, hf_qwen3_next, tmp_path, case):
  hf_config = qwen3_next_config(hidden_size=32, linear_key_head_dim=8, linear_value_head_dim=8, vocab_size=50,
                                intermediate_size=40, **QWEN_MODELS[case])
  torch.manual_seed(11)
  theirs = randomize(torch, hf_qwen3_next.Qwen3NextForCausalLM(hf_config))
  theirs.save_pretrained(tmp_path)  # published checkpoints' form: per-expert tensors, config.json beside them
  ours = qwen_interop.load_model(str(tmp_path))
  assert ours.cfg.mlp_kinds == tuple("moe" if type(l.mlp).__name__ == "Qwen3NextSparseMoeBlock" else "dense"
                                     for l in theirs.model.layers)
  assert ours.cfg.layer_kinds == tuple({"linear_attention": "recurrent", "full_attention": "attention"}[t]
                                       for t in hf_config.layer_types)
  check_model(torch, theirs, ours, 50)
  same_checkpoint(qwen_interop.save_model(ours, tmp_path / "back"), tmp_path, tmp_path / "back")
  if case == "tied_moe_no_renorm":  # transformers' in-memory form: fused gate_up_proj, and an mtp head to skip
    sd = {**theirs.state_dict(), "mtp.fc.weight": torch.zeros(2, 2)}
    tokens = jnp.asarray(np.arange(10)[None])
    np.testing.assert_array_equal(np.asarray(_logits(qwen_interop.load_model(sd, hf_config), tokens)),
                                  np.asarray(_logits(ours, tokens)))


def same_checkpoint(config, original, exported):
  """Import then export gives back the checkpoint: the same tensor names and values ((1 + w) norms to rounding)."""
  a, b = read_safetensors(original), read_safetensors(exported)
  assert sorted(a) == sorted(b)
  for k in a:
    np.testing.assert_allclose(b[k], a[k], rtol=1e-6, atol=1e-7, err_msg=k)
  theirs = json.loads((original / "config.json").read_text())
  for k in ("vocab_size", "hidden_size", "num_hidden_layers", "tie_word_embeddings"):
    assert config[k] == theirs[k]


def perturbed(model, scale=0.2):
  """Our model with every parameter moved off its init, as `randomize` does for torch modules."""
  state = nnx.state(model, nnx.Param)
  leaves, tree = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(0), len(leaves))
  nnx.update(model, jax.tree.unflatten(tree, [x + scale * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]))
  return model


@pytest.mark.interop
def test_qwen3_next_export(torch, hf_qwen3_next, tmp_path):
  """A gdn model (an MoE hybrid with YaRN, built here) saved for transformers, which loads it with our logits."""
  from transformers import Qwen3NextForCausalLM

  hf_config = qwen3_next_config(hidden_size=32, linear_key_head_dim=8, linear_value_head_dim=8, vocab_size=50,
                                intermediate_size=40, **QWEN_MODELS["moe_yarn"])
  ours = perturbed(LanguageModel(qwen_interop.model_config(hf_config), rngs=nnx.Rngs(2)))
  qwen_interop.save_model(ours, tmp_path)
  theirs = Qwen3NextForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
  check_model(torch, theirs, ours, 50)
  for bad, setting in ((dict(pattern="RW"), "pattern"), (dict(norm_eps=1e-5), "norm_eps")):
    cfg = ModelConfig(**{**dict(vocab_size=50, d_model=32, num_layers=2, pattern="RA",
                                attention=dataclasses.replace(ours.cfg.attention, window=4),
                                recurrent=ours.cfg.recurrent), **bad})
    with pytest.raises(ValueError, match=setting):
      qwen_interop.save_model(LanguageModel(cfg, rngs=nnx.Rngs(0)), tmp_path / "refused")


@pytest.mark.interop
def test_load_model_names_what_does_not_fit(tmp_path):
  """Without torch: a checkpoint written by save_model, then spoiled one way at a time."""
  pytest.importorskip("safetensors.numpy")  # the interop extra
  config = dict(hidden_size=16, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=4,
                linear_value_head_dim=4, linear_conv_kernel_dim=4, num_attention_heads=2, num_key_value_heads=1,
                head_dim=8, num_hidden_layers=2, full_attention_interval=2, vocab_size=20, intermediate_size=24,
                rms_norm_eps=1e-6, num_experts=0)
  qwen_interop.save_model(LanguageModel(qwen_interop.model_config(config), rngs=nnx.Rngs(0)), tmp_path)
  sd = read_safetensors(tmp_path)
  qwen_interop.load_model(sd, config)
  with pytest.raises(ValueError, match="model.layers.1.self_attn.extra"):
    qwen_interop.load_model({**sd, "model.layers.1.self_attn.extra": np.zeros(2)}, config)
  with pytest.raises(ValueError, match="vision.proj"):
    qwen_interop.load_model({**sd, "vision.proj": np.zeros(2)}, config)
  with pytest.raises(KeyError, match="model.layers.0.mlp.up_proj.weight"):
    qwen_interop.load_model({k: v for k, v in sd.items() if k != "model.layers.0.mlp.up_proj.weight"}, config)
  with pytest.raises(KeyError, match="lm_head.weight"):
    qwen_interop.load_model({k: v for k, v in sd.items() if k != "lm_head.weight"}, config)
  with pytest.raises(ValueError, match="config is needed"):
    qwen_interop.load_model(sd)
  with pytest.raises(ValueError, match="hidden_act"):
    fla_interop.model_config(dict(hidden_size=16, num_hidden_layers=1, num_heads=2, head_dim=8, vocab_size=20,
                                  hidden_act="gelu"))


@pytest.mark.interop
def test_save_model_unstacks_scanned_layers_ignores_remat_and_keeps_odd_value_widths(tmp_path):
  """Without torch: a model trained as configs/lm_paper.py trains (scanned layers, remat) exports as it is, and a
  value width that V / K rounds one short (K = 11, V = 15) comes back whole; the logits survive the round trip."""
  pytest.importorskip("safetensors.numpy")  # the interop extra
  from gdn.model import stack_layers

  config = dict(hidden_size=16, num_hidden_layers=4, num_heads=2, head_dim=11, expand_v=15 / 11, vocab_size=20,
                intermediate_size=24, attn={"layers": [1, 3], "num_heads": 2})
  cfg = fla_interop.model_config(config)
  assert cfg.recurrent.V == 14  # fla's own int(K * expand_v) of this config: why save_model must write more
  cfg = dataclasses.replace(cfg, pattern="RA", remat="dots", scan_layers=True,
                            recurrent=dataclasses.replace(cfg.recurrent, v_head_dim=15, remat="features"))
  unrolled = perturbed(LanguageModel(dataclasses.replace(cfg, scan_layers=False), rngs=nnx.Rngs(3)))
  scanned = stack_layers(unrolled)
  written = fla_interop.save_model(scanned, tmp_path)
  assert int(written["head_dim"] * written["expand_v"]) == 15
  back = fla_interop.load_model(tmp_path)
  assert back.cfg.recurrent.V == 15 and not back.cfg.scan_layers
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 20, size=(2, 9)))
  np.testing.assert_allclose(np.asarray(back(tokens)), np.asarray(scanned(tokens)), rtol=1e-5, atol=1e-5)


@pytest.mark.interop
def test_a_tensor_beside_the_head_is_refused_and_fla_hidden_ratio_may_be_null(tmp_path):
  """Without torch: a checkpoint key that merely starts with lm_head.weight (a quantizer's scale) has no place in
  our model; fla's config may write hidden_ratio null, which fla reads as 4."""
  pytest.importorskip("safetensors.numpy")  # the interop extra
  config = dict(hidden_size=16, num_hidden_layers=1, num_heads=2, head_dim=8, vocab_size=20, intermediate_size=None,
                hidden_ratio=None)
  cfg = fla_interop.model_config(config)
  assert cfg.mlp_hidden == 256  # 16 x 4 x 2 / 3 rounded up to a multiple of 256, as fla's GatedMLP
  fla_interop.save_model(LanguageModel(cfg, rngs=nnx.Rngs(0)), tmp_path)
  sd = read_safetensors(tmp_path)
  fla_interop.load_model(sd, config)
  for extra in ("lm_head.weight_scale", "lm_head.weight.absmax"):
    with pytest.raises(ValueError, match=extra):
      fla_interop.load_model({**sd, extra: np.ones(2, np.float32)}, config)


# Without torch: the mapping, and errors that name what is wrong.


def seed_state_dict(D=16, H=2, bias=False, seed_=0):
  rng = np.random.default_rng(seed_)
  sd = {f"{n}.weight": rng.normal(size=(D, D)).astype(np.float32)
        for n in ("W_query", "W_key", "W_value", "W_gate", "W_beta", "out_proj")}
  sd.update({"W_alpha.weight": rng.normal(size=(H, D)), "dt_bias": np.ones(H), "A_log": rng.normal(size=H),
             "norm.weight": rng.normal(size=D // H), "out_proj.bias": rng.normal(size=D)})
  if bias:
    sd.update({f"{n}.bias": rng.normal(size=D) for n in ("W_query", "W_key", "W_value")})
  return sd


def test_seed_mapping_without_torch():
  sd = seed_state_dict(bias=True)
  ours = seed.load_mixer(sd)
  np.testing.assert_array_equal(ours.q_proj.kernel[...], sd["W_query.weight"].T)
  np.testing.assert_array_equal(ours.q_proj.bias[...], sd["W_query.bias"].astype(np.float32))
  np.testing.assert_array_equal(ours.b_proj.kernel[...], sd["W_beta.weight"].T)
  np.testing.assert_array_equal(ours.a_proj.kernel[...], sd["W_alpha.weight"].T.astype(np.float32))
  np.testing.assert_array_equal(ours.o_norm.weight[...], sd["norm.weight"].astype(np.float32))
  assert ours.q_proj.kernel[...].dtype == jnp.float32
  assert ours.cfg.beta == "channel" and not ours.cfg.short_conv and ours.cfg.norm_eps == 1e-6


def test_missing_key_is_named():
  sd = seed_state_dict()
  del sd["W_beta.weight"]
  with pytest.raises(KeyError, match="W_beta.weight"):
    seed.load_mixer(sd)
  with pytest.raises(KeyError, match="layers.7.W_beta.weight"):
    seed.load_mixer({f"layers.7.{k}": v for k, v in sd.items()}, prefix="layers.7.")
  with pytest.raises(KeyError, match="prefix 'nope.'"):
    seed.load_mixer(seed_state_dict(), prefix="nope.")


def test_wrong_shape_and_leftover_keys_are_named():
  sd = seed_state_dict()
  sd["W_gate.weight"] = sd["W_gate.weight"][:, :8]
  with pytest.raises(ValueError, match=r"W_gate.weight.*\(16, 8\)"):
    seed.load_mixer(sd)
  sd = seed_state_dict()
  sd["conv.weight"] = np.zeros((4, 16))
  with pytest.raises(ValueError, match="conv.weight"):
    seed.load_mixer(sd)
  sd = seed_state_dict()
  sd["W_query.weight"] = np.zeros((16, 12))
  with pytest.raises(ValueError, match="d_in=12"):
    seed.load_mixer(sd)


def test_module_from_another_config_is_refused():
  cfg, d_model = seed.mixer_config(seed_state_dict())
  other = RecurrentMixer(recurrent_preset("seed", num_heads=2, head_dim=8, norm_eps=1e-5), d_model, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="norm_eps"):
    seed.load_mixer(seed_state_dict(), module=other)
  same_but_chunked = RecurrentMixer(dataclasses.replace(cfg, method="chunk", chunk_size=16), d_model, rngs=nnx.Rngs(0))
  seed.load_mixer(seed_state_dict(), module=same_but_chunked)  # free fields may differ


def test_fla_needs_heads_and_maps_the_short_conv():
  rng = np.random.default_rng(0)
  D, H, K, HV, V, W = 16, 2, 4, 2, 8, 4
  sd = {"q_proj.weight": rng.normal(size=(H * K, D)), "k_proj.weight": rng.normal(size=(H * K, D)),
        "v_proj.weight": rng.normal(size=(HV * V, D)), "a_proj.weight": rng.normal(size=(HV, D)),
        "b_proj.weight": rng.normal(size=(HV, D)), "A_log": rng.normal(size=HV), "dt_bias": rng.normal(size=HV),
        "q_conv1d.weight": rng.normal(size=(H * K, 1, W)), "k_conv1d.weight": rng.normal(size=(H * K, 1, W)),
        "v_conv1d.weight": rng.normal(size=(HV * V, 1, W)), "g_proj.weight": rng.normal(size=(HV * V, D)),
        "o_norm.weight": rng.normal(size=V), "o_proj.weight": rng.normal(size=(D, HV * V))}
  with pytest.raises(ValueError, match="num_heads or head_dim"):
    fla_interop.load_mixer(sd)
  ours = fla_interop.load_mixer(sd, head_dim=K)
  assert (ours.cfg.num_heads, ours.cfg.norm_eps, ours.cfg.conv_size) == (H, 1e-5, W)
  # Our conv weight [W, C] over [q | k | v] is fla's three [C, 1, W] weights.
  np.testing.assert_allclose(ours.conv.weight[...][:, H * K:2 * H * K], sd["k_conv1d.weight"][:, 0].T, rtol=1e-6)
  # conv_bias=True: the three biases, concatenated as the channels; all three or none.
  biases = {f"{n}_conv1d.bias": rng.normal(size=c) for n, c in (("q", H * K), ("k", H * K), ("v", HV * V))}
  ours = fla_interop.load_mixer({**sd, **biases}, head_dim=K)
  assert ours.cfg.conv_bias
  np.testing.assert_allclose(ours.conv.bias[...][2 * H * K:], biases["v_conv1d.bias"], rtol=1e-6)
  with pytest.raises(KeyError, match="k_conv1d.bias"):
    fla_interop.load_mixer({**sd, "q_conv1d.bias": biases["q_conv1d.bias"]}, head_dim=K)
  # use_short_conv=False: no conv, SiLU on the projections.
  ours = fla_interop.load_mixer({k: v for k, v in sd.items() if "conv1d" not in k}, head_dim=K)
  assert ours.conv is None and ours.cfg.silu_without_conv


def test_qwen3_next_qkvz_is_regrouped_by_head():
  # Rows of in_proj_qkvz tagged by what they are: q/k head h gives rows [q_h, k_h, v_(h,0..G-1), z_(h,0..G-1)].
  H, HV, K, V, D = 2, 4, 3, 5, 7
  G = HV // H
  hf_config = dict(linear_num_key_heads=H, linear_num_value_heads=HV, linear_key_head_dim=K,
                   linear_value_head_dim=V, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, hidden_size=D)
  tag = lambda kind, head, i: 1000 * kind + 100 * head + i
  rows = []
  for h in range(H):
    rows += [tag(1, h, i) for i in range(K)] + [tag(2, h, i) for i in range(K)]
    rows += [tag(3, h * G + g, i) for g in range(G) for i in range(V)]
    rows += [tag(4, h * G + g, i) for g in range(G) for i in range(V)]
  qkvz = np.repeat(np.asarray(rows, np.float32)[:, None], D, axis=1)
  ba = np.repeat(np.asarray([tag(k, h * G + g, 0) for h in range(H) for k in (5, 6) for g in range(G)],
                            np.float32)[:, None], D, axis=1)
  sd = {"in_proj_qkvz.weight": qkvz, "in_proj_ba.weight": ba, "conv1d.weight": np.zeros((2 * H * K + HV * V, 1, 4)),
        "A_log": np.zeros(HV), "dt_bias": np.zeros(HV), "norm.weight": np.ones(V),
        "out_proj.weight": np.zeros((D, HV * V))}
  ours = qwen_interop.load_gated_deltanet(sd, hf_config)
  expect = lambda kind, heads, n: np.asarray([tag(kind, h, i) for h in range(heads) for i in range(n)], np.float32)
  np.testing.assert_array_equal(ours.q_proj.kernel[...][0], expect(1, H, K))
  np.testing.assert_array_equal(ours.k_proj.kernel[...][0], expect(2, H, K))
  np.testing.assert_array_equal(ours.v_proj.kernel[...][0], expect(3, HV, V))
  np.testing.assert_array_equal(ours.g_proj.kernel[...][0], expect(4, HV, V))
  np.testing.assert_array_equal(ours.b_proj.kernel[...][0], expect(5, HV, 1))
  np.testing.assert_array_equal(ours.a_proj.kernel[...][0], expect(6, HV, 1))


def test_qwen3_next_config_fields_are_named():
  with pytest.raises(KeyError, match="linear_num_key_heads"):
    qwen_interop.gated_deltanet_config({"hidden_size": 8})
  attention = {"hidden_size": 8, "num_attention_heads": 2, "rms_norm_eps": 1e-6}
  for key in ("rope_parameters", "rope_scaling"):
    with pytest.raises(ValueError, match="'longrope'"):
      qwen_interop.attention_config({**attention, key: {"rope_type": "longrope", "rope_theta": 1e4}})
  with pytest.raises(ValueError, match="rope_original_max_len"):
    qwen_interop.attention_config({**attention, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                                 "original_max_position_embeddings": 0}})


@pytest.mark.interop
def test_read_safetensors_index_opens_only_needed_shards(tmp_path):
  safetensors_numpy = pytest.importorskip("safetensors.numpy")
  safetensors_numpy.save_file({"a.x": np.ones(2, np.float32)}, str(tmp_path / "one.safetensors"))
  safetensors_numpy.save_file({"b.x": np.zeros(3, np.float32)}, str(tmp_path / "two.safetensors"))
  index = {"weight_map": {"a.x": "one.safetensors", "b.x": "two.safetensors", "c.x": "missing.safetensors"}}
  (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
  assert list(read_safetensors(tmp_path, prefix="b.")) == ["x"]
  assert sorted(Tensors(str(tmp_path / "two.safetensors")).keys()) == ["b.x"]
  with pytest.raises(FileNotFoundError, match="nothing.safetensors"):
    read_safetensors(tmp_path / "nothing.safetensors")
