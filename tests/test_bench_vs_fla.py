"""experiments/bench_vs_fla.py: its gdn half at a tiny shape on CPU, its inputs for both variants against the
float64 oracle and the KDA recurrence, and its fla half's plumbing with a PyTorch stand-in for fla's kernels (fla
itself runs only on CUDA; the GPU test compares the real kernels)."""

import gzip
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import bench_vs_fla
from gdn.bench import op_inputs
from reference import gated_delta_rule_ref

pytestmark = pytest.mark.usefixtures("fast_compile")


def table(out: str) -> list:
  """The markdown table's rows as dicts keyed by the header's cells."""
  lines = [l for l in out.splitlines() if l.startswith("|")]
  header = [c.strip() for c in lines[0].strip("|").split("|")]
  return [dict(zip(header, (c.strip() for c in l.strip("|").split("|")))) for l in lines[2:]]


@pytest.mark.parametrize("variant", ["gdn", "kda"])
def test_gdn_half_runs_on_cpu(variant, capsys, tmp_path):
  rows = bench_vs_fla.main(["--gdn-only", "--variant", variant, "--shapes", "1,64,1,16", "--reps", "1",
                            "--hlo", str(tmp_path)])
  out = capsys.readouterr().out
  path = tmp_path / f"gdn_{variant}_1_64_1_16.hlo.txt.gz"  # the compiled forward+backward, as --profile traces it
  assert f"hlo: {path}" in out and "ENTRY" in gzip.open(path, "rt").read()
  assert out.startswith(f"# {variant}: gdn method='pallas' vs fla ") and "fla skipped: --gdn-only" in out, out
  (row,) = table(out)
  assert row["B, T, H, D"] == "1, 64, 1, 16"
  assert float(row["gdn fwd ms"]) > 0 and float(row["gdn fwd+bwd ms"]) > 0
  for col in ("fla fwd ms", "gdn/fla fwd", "fla fwd+bwd ms", "gdn/fla fwd+bwd", "rel err o", "rel err grads"):
    assert row[col] == "-", (col, row)
  assert [r["shape"] for r in rows] == [(1, 64, 1, 16)] and "fla_fwd" not in rows[0]


def test_value_heads_of_another_width(capsys):
  """--shapes B,T,H,K,V: v and the output's cotangent V wide, q and k K wide (the 340M model's K = 256, V = 512,
  scaled down), the same draws as B,T,H,D where K = V; a malformed shape is refused naming the flag."""
  (q, k, v, g, beta), do = bench_vs_fla.variant_inputs("kda", (2, 8, 3, 4, 6), jnp.bfloat16, jnp.float32)
  assert q.shape == k.shape == g.shape == (2, 8, 3, 4) and v.shape == do.shape == (2, 8, 3, 6)
  same, wide = (bench_vs_fla.variant_inputs("gdn", s, jnp.float32, jnp.float32) for s in ((1, 8, 2, 4),
                                                                                         (1, 8, 2, 4, 4)))
  for a, b in zip(same[0] + [same[1]], wide[0] + [wide[1]]):
    np.testing.assert_array_equal(a, b)
  rows = bench_vs_fla.main(["--gdn-only", "--shapes", "1,64,1,16,32", "--reps", "1"])
  out = capsys.readouterr().out
  (row,) = table(out)
  assert row["B, T, H, K, V"] == "1, 64, 1, 16, 32" and float(row["gdn fwd+bwd ms"]) > 0
  assert [r["shape"] for r in rows] == [(1, 64, 1, 16, 32)]
  for bad in ("1,64,1", "1,64,1,16,32,8", "1,64,0,16", "1,64,1,x"):
    with pytest.raises(SystemExit):
      bench_vs_fla.main(["--gdn-only", "--shapes", bad])
    assert "--shapes" in capsys.readouterr().err
  with pytest.raises(ValueError, match="B,T,H,K,V"):
    op_inputs.inputs((1, 8, 2), jnp.float32)


def test_switch_prints_a_table_per_setting_and_restores_it(monkeypatch, capsys, tmp_path):
  """--switch: one table per setting, gdn's side built with the module switch set to it, then restored (with
  --hlo, one program per setting); a bad spec is refused naming the flag."""
  from gdn.ops import intra_chunk

  seen, build = [], bench_vs_fla.gdn_side
  monkeypatch.setattr(bench_vs_fla, "gdn_side",
                      lambda *a: (seen.append(intra_chunk.SEGSUM_MATMUL), build(*a))[1])
  before = intra_chunk.SEGSUM_MATMUL
  rows = bench_vs_fla.main(["--gdn-only", "--variant", "kda", "--shapes", "1,64,1,16", "--reps", "1",
                            "--switch", "intra_chunk.SEGSUM_MATMUL=on,off", "--hlo", str(tmp_path)])
  out = capsys.readouterr().out
  assert seen == [True, False] and intra_chunk.SEGSUM_MATMUL is before
  texts = [gzip.open(tmp_path / f"gdn_kda_1_64_1_16_SEGSUM_MATMUL_{s}.hlo.txt.gz", "rt").read() for s in ("on", "off")]
  assert all("ENTRY" in t for t in texts) and texts[0] != texts[1] and f"hlo: {tmp_path}" in out
  assert [r["switch"] for r in rows] == ["on", "off"]
  assert out.count("| B, T, H, D |") == 2 and "## gdn with gdn.ops.intra_chunk.SEGSUM_MATMUL=off" in out
  for bad in ("intra_chunk.SEGSUM_MATMUL=yes", "intra_chunk.NO_SUCH=on", "nomodule.X=on", "SEGSUM_MATMUL",
              "intra_chunk.LOWP_SOLVE=fwd"):
    with pytest.raises(SystemExit):
      bench_vs_fla.main(["--gdn-only", "--shapes", "1,64,1,16", "--switch", bad])
    assert "--switch" in capsys.readouterr().err


def test_variant_inputs_shapes_and_dtypes():
  shape = (2, 8, 3, 4)
  for variant, g_shape in (("gdn", (2, 8, 3)), ("kda", (2, 8, 3, 4))):
    (q, k, v, g, beta), do = bench_vs_fla.variant_inputs(variant, shape, jnp.bfloat16, jnp.float32)
    assert q.shape == k.shape == v.shape == do.shape == shape and beta.shape == shape[:3]
    assert g.shape == g_shape and g.dtype == jnp.float32 and q.dtype == beta.dtype == do.dtype == jnp.bfloat16
    assert np.log(0.9) - 1e-6 <= float(g.min()) and float(g.max()) <= 0
    np.testing.assert_allclose(np.linalg.norm(np.asarray(k, np.float32), axis=-1), 1, atol=1e-2)
  with pytest.raises(ValueError, match="g_kind"):
    op_inputs.inputs(shape, jnp.float32, "value")


def test_fla_kwargs_leave_the_recurrence_plain():
  """Both fla kernels get g, beta, q and k as they are (no gate activation, sigmoid or L2 norm in the kernel)
  and gdn's default scale; safe_gate is chunk_kda's opt-in only."""
  plain = dict(scale=0.125, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
               use_beta_sigmoid_in_kernel=False)
  assert bench_vs_fla.fla_kwargs("gdn", 64) == plain
  assert bench_vs_fla.fla_kwargs("kda", 64) == dict(plain, use_gate_in_kernel=False, safe_gate=False,
                                                    lower_bound=None)
  assert bench_vs_fla.fla_kwargs("kda", 64, safe_gate=True)["lower_bound"] == -5.0
  with pytest.raises(ValueError, match="safe_gate"):
    bench_vs_fla.fla_kwargs("gdn", 64, safe_gate=True)


def naive_kda(q, k, v, g, beta, scale):
  """KDA's token loop written as fla's naive reference writes it, in PyTorch (q scaled first; the state decayed
  per key channel, then the delta write beta k (v - k^T S); o = q^T S); g [B, T, H] is taken as one decay for
  every key channel. Float64; differentiable."""
  import torch

  q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
  g = g[..., None].expand(k.shape) if g.dim() == 3 else g
  B, T, H, K = q.shape
  S = q.new_zeros(B, H, K, v.shape[-1])
  q = q * scale
  o = []
  for t in range(T):
    S = S * g[:, t, :, :, None].exp()
    err = v[:, t] - (k[:, t, :, :, None] * S).sum(-2)
    S = S + (beta[:, t, :, None] * k[:, t])[..., None] * err[:, :, None, :]
    o.append((q[:, t, :, :, None] * S).sum(-2))
  return torch.stack(o, 1)


@pytest.mark.parametrize("variant", ["gdn", "kda"])
def test_inputs_through_the_oracle_are_the_kda_recurrence(variant):
  """What the bench hands gdn, through the float64 oracle of tests/test_ops.py, is what KDA's naive formula gives
  on the same numbers; and gdn's method="pallas" (Pallas' interpreter) agrees with both."""
  pytest.importorskip("torch")
  shape = (1, 70, 2, 8)
  args, _ = bench_vs_fla.variant_inputs(variant, shape, jnp.float32, jnp.float32)
  want, _ = gated_delta_rule_ref(*args)
  got = naive_kda(*(bench_vs_fla.to_torch(x) for x in args), scale=shape[-1] ** -0.5)
  np.testing.assert_allclose(got.numpy(), want, rtol=1e-10, atol=1e-10)
  o = bench_vs_fla.gdn_side(args, None)[0]()
  np.testing.assert_allclose(np.asarray(o), want, rtol=2e-4, atol=2e-4)


def test_fla_naive_kda_agrees_when_fla_is_importable():
  """fla's own `naive_recurrent_kda` (pure PyTorch, CPU; float32 inside) on the bench's KDA inputs against the
  float64 oracle."""
  pytest.importorskip("torch")
  naive = pytest.importorskip("fla.ops.kda.naive")
  args, _ = bench_vs_fla.variant_inputs("kda", (1, 40, 2, 8), jnp.float32, jnp.float32)
  want, _ = gated_delta_rule_ref(*args)
  t = [bench_vs_fla.to_torch(x).double() for x in args]
  o, _ = naive.naive_recurrent_kda(*t, scale=8**-0.5)
  np.testing.assert_allclose(o.numpy(), want, rtol=1e-5, atol=1e-5)  # it computes in float32


def test_to_torch_copies_bit_for_bit():
  torch = pytest.importorskip("torch")
  x = jax.random.normal(jax.random.key(0), (3, 5), jnp.bfloat16) * 1e3
  t = bench_vs_fla.to_torch(x, requires_grad=True)
  assert t.dtype == torch.bfloat16 and t.requires_grad and tuple(t.shape) == (3, 5)
  np.testing.assert_array_equal(t.detach().float().numpy(), np.asarray(x, np.float32))
  assert bench_vs_fla.to_torch(jnp.ones(2, jnp.float32)).dtype == torch.float32


@pytest.mark.parametrize("shape", [(1, 70, 2, 8), (1, 70, 2, 8, 16)], ids=["K=V", "V=2K"])
@pytest.mark.parametrize("variant", ["gdn", "kda"])
def test_fla_half_with_a_stand_in(variant, shape, monkeypatch):
  """fla_side as the bench builds it, with fla's kernel replaced by the PyTorch token loop (on CPU): it is called
  with the plain flags (scale K ** -0.5), and its output and gradients match gdn's side on the same inputs
  (float32), for value heads as wide as the keys and twice as wide (the 340M model's heads)."""
  pytest.importorskip("torch")
  module, name = bench_vs_fla.VARIANTS[variant]["fla"]
  kw = bench_vs_fla.fla_kwargs(variant, shape[3])
  assert kw["scale"] == 8**-0.5

  def stand_in(q, k, v, g, beta, **got):
    assert got == kw
    return naive_kda(q, k, v, g, beta, got["scale"]).float(), None

  monkeypatch.setitem(sys.modules, module, types.SimpleNamespace(**{name: stand_in}))
  args, do = bench_vs_fla.variant_inputs(variant, shape, jnp.float32, jnp.float32)
  f_fwd, f_fb, f_sync = bench_vs_fla.fla_side(variant, args, do, kw, device="cpu")
  g_fwd, g_fb, g_sync = bench_vs_fla.gdn_side(args, do)
  o_fla, o_gdn = f_fwd(), g_fwd()
  f_sync(o_fla), g_sync(o_gdn)
  assert not o_fla.requires_grad  # the forward runs without autograd
  assert bench_vs_fla.rel_err(o_fla.numpy(), o_gdn) < 1e-4
  grads_fla, grads_gdn = f_fb(), g_fb()
  assert len(grads_fla) == len(grads_gdn) == 5
  for a, b in zip(grads_fla, grads_gdn):
    assert a.shape == b.shape
    assert bench_vs_fla.rel_err(a.detach().numpy(), b) < 1e-3


def test_a_failing_fla_side_leaves_gdn_timed():
  """With torch given but no CUDA, fla's side fails to build (its copies go to "cuda"); the row keeps gdn's
  timings and fla's error, and no ratio or error is made up."""
  torch = pytest.importorskip("torch")
  if torch.cuda.is_available():
    pytest.skip("needs a machine without CUDA for torch")
  row = bench_vs_fla.measure("kda", (1, 64, 1, 16), jnp.float32, jnp.float32, 1, torch=torch)
  assert row["gdn_fwd"] > 0 and row["gdn_fb"] > 0 and "fla_error" in row
  assert not {"fla_fwd", "fla_fb", "rel_err", "grad_rel_err"} & set(row)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["2,1024,4,128", "1,1024,2,256,512"])
@pytest.mark.parametrize("variant", ["gdn", "kda"])
def test_fla_and_gdn_agree_on_gpu(variant, shape, capsys):
  """On a CUDA machine with fla: one row per variant, both sides timed, outputs and gradients close (bf16), with
  K = V and with the 340M model's heads (K = 256, V = 512)."""
  pytest.importorskip("torch")
  pytest.importorskip("fla")
  (row,) = bench_vs_fla.main(["--variant", variant, "--shapes", shape, "--reps", "2"])
  print(capsys.readouterr().out)
  assert all(row[k] > 0 for k in ("fla_fwd", "gdn_fwd", "fla_fb", "gdn_fb"))
  assert row["rel_err"] < 3e-2, row
  assert np.isfinite(row["grad_rel_err"]), row
