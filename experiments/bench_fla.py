"""Reference timings of fla's Triton `chunk_gated_delta_rule` (PyTorch, CUDA only), in bench_ops' table format.

  python -m experiments.bench_fla            # needs torch, triton, flash-linear-attention on a CUDA machine
  python -m experiments.bench_fla --shapes 4,4096,64,128 8,1024,8,64

fla 0.6.0 refuses its gated backward on Hopper with Triton < 3.7.1 (a numerics guard); for timing only we
set `fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1 = True`, and the table says so.
"""

from __future__ import annotations

import argparse

from gdn.bench.op_inputs import PRESETS


def main(argv=None):
  import torch
  import triton
  import fla.ops.common.chunk_o as chunk_o
  from fla.ops.gated_delta_rule import chunk_gated_delta_rule

  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--preset", choices=sorted(PRESETS), default="h200")
  p.add_argument("--shapes", nargs="*", help="override the preset's shapes, each as B,T,H,D")
  a = p.parse_args(argv)
  if not torch.cuda.is_available():
    raise SystemExit("bench_fla times fla's Triton kernels and needs CUDA (torch finds no GPU here); "
                     "`python -m experiments.bench_ops --preset cpu` times gdn's ops on this machine")
  shapes = [tuple(map(int, s.split(","))) for s in a.shapes] if a.shapes else PRESETS[a.preset]["shapes"]
  patched = not getattr(chunk_o, "TRITON_ABOVE_3_7_1", True)
  chunk_o.TRITON_ABOVE_3_7_1 = True
  dev = "cuda"
  print(f"# fla chunk_gated_delta_rule, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"triton {triton.__version__}, bfloat16, median of triton.testing.do_bench"
        + (" (TRITON_ABOVE_3_7_1 forced for the backward)" if patched else ""))
  print("| B, T, H, D | method | fwd ms | fwd+bwd ms | fwd mem MiB | fwd+bwd mem MiB |")
  print("|---|---|---|---|---|---|")
  for B, T, H, D in shapes:
    torch.manual_seed(0)
    mk = lambda *s: torch.randn(*s, device=dev, dtype=torch.bfloat16)
    q, v = mk(B, T, H, D), mk(B, T, H, D)
    k = torch.nn.functional.normalize(mk(B, T, H, D).float(), dim=-1).to(torch.bfloat16)
    g = torch.log(torch.empty(B, T, H, device=dev).uniform_(0.9, 1.0))
    beta = torch.rand(B, T, H, device=dev, dtype=torch.bfloat16)
    leaves = [x.requires_grad_() for x in (q, k, v, g, beta)]
    do = mk(B, T, H, D)

    def fwd():
      return chunk_gated_delta_rule(*leaves, scale=D**-0.5)[0]

    def fwd_bwd():
      torch.autograd.grad(fwd(), leaves, do)

    row = []
    for fn in (fwd, fwd_bwd):
      torch.cuda.synchronize()
      torch.cuda.reset_peak_memory_stats()
      ms = triton.testing.do_bench(fn, return_mode="median")
      row.append((ms, torch.cuda.max_memory_allocated() / 2**20))
    print(f"| {B}, {T}, {H}, {D} | fla | {row[0][0]:.2f} | {row[1][0]:.2f} | {row[0][1]:.0f} | "
          f"{row[1][1]:.0f} |", flush=True)


if __name__ == "__main__":
  main()
