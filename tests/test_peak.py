"""gdn.bench.peak reads what is live at a compiled program's memory peak from XLA's buffer assignment; the ops and
the layer name their stages, so that the table says which stage made each buffer."""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn.bench.peak import format_peak, grouped, hlo_bytes, live_at_peak, shape_bytes, short_op
from gdn.bench.timing import compiled_bytes
from gdn.ops import checks


def _loss(x, w):
  with jax.named_scope("wide"):
    h = jnp.tanh(x @ w)  # [512, 1024]: kept for the backward
  return jnp.sum(h @ w.T)


def test_the_peak_holds_the_named_residual_and_is_near_the_estimate():
  x, w = jnp.ones((512, 256)), jnp.ones((256, 1024))
  lowered = jax.jit(jax.grad(_loss, argnums=(0, 1))).lower(x, w)
  peak = live_at_peak(lowered)
  assert peak["total"] == sum(b["bytes"] for b in peak["buffers"]) > 0
  # The live ranges count an in-place result beside the operand whose memory it takes: near XLA's total, not under it.
  assert 0.5 < peak["total"] / compiled_bytes(lowered.compile()) < 1.5
  assert [b["bytes"] for b in peak["buffers"]] == sorted((b["bytes"] for b in peak["buffers"]), reverse=True)
  wide = [b for b in peak["buffers"] if b["shape"] == "f32[512,1024]"]
  assert wide and any("wide" in b["op_name"] for b in wide), peak["buffers"]
  rows = grouped(peak["buffers"])
  assert sum(r[0] for r in rows) == peak["total"] and sum(r[1] for r in rows) == len(peak["buffers"])
  table = format_peak(peak, per=512, unit="bytes/row", top=3)
  assert table.splitlines()[0].startswith("live at the peak: ") and len(table.splitlines()) == 3 + 3


def test_short_op_names_the_side_and_the_last_scopes():
  assert short_op("jit(loss)/transpose(jvp(gated_delta_rule))/chunk_local/dot_general") == \
      "bwd: gated_delta_rule/chunk_local/dot_general"
  assert short_op("jit(loss)/jvp(short_conv)/slice", keep=2) == "fwd: short_conv/slice"


def test_scoped_names_the_stage_and_changes_nothing():
  f = lambda x: jnp.sin(x) * 2
  g = checks.scoped("stage")(f)
  x = jnp.arange(4.0)
  np.testing.assert_array_equal(g(x), f(x))
  assert "stage" in jax.jit(g).lower(x).as_text(debug_info=True)


def test_the_layer_buffers_are_named_by_stage():
  from experiments.bench_layer_fla import PRESETS, gdn_side
  a = argparse.Namespace(**PRESETS["cpu"], method="chunk", peak=40)
  out = gdn_side(a, 128)
  names = " ".join(r[3] for r in out["live"]["rows"])
  for stage in ("short_conv", "chunk_local"):
    assert stage in names, names
  assert 0.5 < out["live"]["total"] / out["estimate"] < 1.5
  assert out["live"]["allocation"].startswith("XLA's allocation ") and "holds no live buffer there" in \
      out["live"]["allocation"]


def test_the_allocation_and_its_slices_are_read_with_the_live_set():
  """XLA's memory analysis comes back beside the live set, and the memory-usage report's slices parse: each
  names its size, offset and the values sharing it; the slices of the one block of temporaries hold every
  temporary byte."""
  from gdn.bench.peak import allocation_line, slices
  x, w = jnp.ones((512, 256)), jnp.ones((256, 1024))
  peak = live_at_peak(jax.jit(jax.grad(_loss, argnums=(0, 1))).lower(x, w))
  # x and w in, their gradients out (and the output tuple's table of pointers)
  assert peak["arguments"] == (512 * 256 + 256 * 1024) * 4 <= peak["outputs"] < peak["arguments"] + 1024
  assert peak["temp"] > 0 and peak["slices"] and all(r["bytes"] > 0 and r["values"] >= 1 for r in peak["slices"])
  assert sum(r["bytes"] for r in peak["slices"]) >= peak["temp"]
  assert "f32[512,1024]" in " ".join(r["shapes"] for r in peak["slices"])
  line = allocation_line(peak)
  assert line.startswith(f"XLA's allocation {(peak['arguments'] + peak['outputs'] + peak['temp']) / 2**30:.2f} GiB")
  report = ("  768.00MiB(  8%);  768.00MiB;            0;                4; bf16[65536,2048], s8[33554432]\n"
            "    1.50GiB( 17%);  256.00MiB;    805306368;                1; bf16[8,8192,2048]\n")
  assert slices(report) == [dict(bytes=768 * 2**20, offset=0, values=4, shapes="bf16[65536,2048], s8[33554432]"),
                            dict(bytes=256 * 2**20, offset=805306368, values=1, shapes="bf16[8,8192,2048]")]


def test_saved_by_autograd_counts_each_kept_tensor_once():
  torch = pytest.importorskip("torch")
  from experiments.bench_layer_fla import saved_by_autograd
  lin = torch.nn.Linear(64, 32)
  x = torch.randn(8, 64, requires_grad=True)
  live = saved_by_autograd(lambda: torch.tanh(lin(x)) * torch.tanh(lin(x)), top=10)
  # Per branch: x and the weight (shared by both branches, counted once), and tanh's output; mul keeps both tanhs.
  assert live["total"] == 8 * 64 * 4 + 64 * 32 * 4 + 2 * 8 * 32 * 4, live
  assert live["rows"][0][2] == "float32[64, 32]"


def test_a_program_in_the_persistent_cache_is_compiled_again_for_its_dump(tmp_path):
  """XLA dumps only what it compiles, and the dump options are not in the persistent cache's key: a program that
  the cache holds (here compiled once before, in a process whose cache is on) still gets its live range."""
  from devices import run_child

  out = run_child(__file__, str(tmp_path / "jax_cache"), devices=1)
  assert out["entries"] > 0 and out["rows"] > 0 and out["cache_on_after"], out


def test_shape_bytes_counts_arrays_and_tuples():
  assert shape_bytes("f32[64,128]{1,0}") == 64 * 128 * 4 and shape_bytes("bf16[8]{0}") == 16
  assert shape_bytes("(f32[2,3]{1,0}, /*index=1*/pred[5]{0}, s4[4]{0})") == 24 + 5 + 2
  assert shape_bytes("f32[]") == 4 and shape_bytes("token[]") == 0 and shape_bytes("f8e4m3fn[10]{0}") == 10


def test_hlo_bytes_is_what_each_kernel_reads_and_writes():
  """A matmul's kernel reads both operands and writes its result; the elementwise kernel after it reads the
  matmul's float32 result and writes bfloat16: the bytes the compiled module's shapes give, whatever XLA:CPU
  fuses."""
  f = jax.jit(lambda a, b: (jnp.tanh(a @ b) * 2 + 1).astype(jnp.bfloat16))
  hlo = f.lower(jnp.ones((64, 128)), jnp.ones((128, 32))).compile().as_text()
  sizes = hlo_bytes(hlo)
  entry = hlo[hlo.index("ENTRY"):]
  kernels = [line.split("=")[0].strip().removeprefix("ROOT ").lstrip("%") for line in entry.splitlines()
             if " fusion(" in line or " dot(" in line]
  assert kernels, entry
  a, b, out = 64 * 128 * 4, 128 * 32 * 4, 64 * 32
  expected = {1: [a + b + 2 * out],  # one kernel: both operands in, the bfloat16 result out
              2: sorted([a + b + 4 * out, 4 * out + 2 * out])}  # the matmul, then the elementwise kernel
  assert sorted(sizes[k] for k in kernels) == expected[len(kernels)], entry


if __name__ == "__main__":
  import json
  import os
  import sys

  cache = sys.argv[1]
  jax.config.update("jax_compilation_cache_dir", cache)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  x, w = jnp.ones((64, 32)), jnp.ones((32, 128))
  lowered = jax.jit(jax.grad(_loss, argnums=(0, 1))).lower(x, w)
  lowered.compile()  # into the cache
  entries = len(os.listdir(cache))
  rows = len(live_at_peak(lowered)["buffers"])
  # The cache is back on for what follows: a new program is written to it.
  jax.jit(lambda a: a * 3 + 1).lower(x).compile()
  print(json.dumps(dict(entries=entries, rows=rows, cache_on_after=len(os.listdir(cache)) > entries)))

