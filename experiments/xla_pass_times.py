"""Where XLA's compile time goes, pass by pass, from a dump of the module after every pass.

  XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_pass_re=.* --xla_dump_hlo_module_re=.*train_step.*" \\
    python -m experiments.bench_model --config configs/lm_hybrids.py --sweep-model kda_3to1 --batch 64 --seq-len 512
  python -m experiments.xla_pass_times /tmp/dump

XLA writes `<module>.<NNNN>.<pipeline>.after_<pass>.before_<next>.txt` as a pass ends that changed the module, so
the time between one file and the one before it is that pass's, with any passes between that changed nothing and
the writing of the dump (compare passes with each other, not the total with an undumped compile). The table sums
those gaps per pass over the files that match --module, the slowest first, then lists the slowest single gaps.
A pass that takes minutes on a large module (constant folding of a big constant expression, say) stands out at
once.
"""

from __future__ import annotations

import argparse
import collections
import os
import re

_AFTER = re.compile(r"\.after_([^.]+)(?:\.before_[^.]+)?\.txt$")


def pass_of(name: str) -> str:
  """The pass whose end a dump file marks ("constant_folding" for `...after_constant_folding.before_...txt`), or
  the file's name without its module prefix for the other dumps (before_optimizations, the buffer assignment ..)."""
  m = _AFTER.search(name)
  return m.group(1) if m else name.split(".", 2)[-1]


def gaps(directory: str, module: str = ".*") -> list[tuple[float, str]]:
  """(seconds since the previous file, file name) for each file of `directory` (in the order written) whose name
  matches the regular expression `module`, the first file excluded."""
  pattern = re.compile(module)
  files = sorted((os.path.getmtime(os.path.join(directory, f)), f) for f in os.listdir(directory)
                 if pattern.search(f) and os.path.isfile(os.path.join(directory, f)))
  return [(t1 - t0, f) for (t0, _), (t1, f) in zip(files, files[1:])]


def summary(directory: str, module: str = ".*", top: int = 20) -> str:
  g = gaps(directory, module)
  if not g:
    return f"no dump files matching {module!r} in {directory}"
  per_pass = collections.Counter()
  for dt, f in g:
    per_pass[pass_of(f)] += dt
  lines = [f"{len(g) + 1} files over {sum(dt for dt, _ in g):.1f} s", "| pass | seconds | share |", "|---|---:|---:|"]
  total = sum(per_pass.values())
  lines += [f"| {p} | {s:.2f} | {s / total:.0%} |" for p, s in per_pass.most_common(top)]
  lines += ["", "slowest single gaps:"]
  lines += [f"  {dt:8.2f} s  {f}" for dt, f in sorted(g, reverse=True)[:min(top, 10)]]
  return "\n".join(lines)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("directory", help="XLA's --xla_dump_to directory")
  ap.add_argument("--module", default=".*", help="a regular expression the dump files' names must match")
  ap.add_argument("--top", type=int, default=20, help="passes listed")
  args = ap.parse_args(argv)
  print(summary(args.directory, args.module, args.top))


if __name__ == "__main__":
  main()
