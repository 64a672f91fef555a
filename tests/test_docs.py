"""The docs cite committed results: every results file named in README.md and docs/*.md exists, by its path, or
by its bare name (in backticks) somewhere under results/."""

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
# A file under results/ (a whole path), or under results/benchmarks/ by its folder of a card or CPU and a date
# ("h200_2026-12-05/kda_dyadic_op.txt"), the short form the benchmark pages use; globs allowed.
FULL = re.compile(r"results/[\w./*\-]+\.(?:txt|md|csv|json|jsonl|png|tgz)\b")
SHORT = re.compile(r"(?<![\w/])((?:h100|h200|cpu)\w*_20\d\d-\d\d-\d\d/[\w.*\-]+\.(?:txt|md|csv|json|png))\b")
BARE = re.compile(r"`([\w.\-]+\.(?:txt|csv|png))`")  # a results file named alone, its folder in the sentence


def cited(text: str) -> set:
  paths = {m.group(0) for m in FULL.finditer(text)}
  return paths | {"results/benchmarks/" + m.group(1) for m in SHORT.finditer(text)}


def test_the_pattern_finds_both_forms():
  text = ("see `results/lm_hybrids/table.md` and h100_2026-12-06/vs_fla_kda.txt, "
          "`results/benchmarks/h200_2026-12-01/model_340m_*.txt`")
  assert cited(text) == {"results/lm_hybrids/table.md", "results/benchmarks/h100_2026-12-06/vs_fla_kda.txt",
                         "results/benchmarks/h200_2026-12-01/model_340m_*.txt"}


def test_every_cited_results_file_is_committed():
  missing = []
  for doc in DOCS:
    with open(os.path.join(ROOT, doc)) as f:
      text = f.read()
    for path in sorted(cited(text)):
      if "/runs/" in path:  # run directories are the machine's, not the repository's
        continue
      if not glob.glob(os.path.join(ROOT, path)):
        missing.append(f"{doc}: {path}")
  assert not missing, "cited but not in the repository:\n" + "\n".join(missing)


def test_every_results_file_named_alone_exists_under_results():
  names = {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "results", "**", "*"), recursive=True)}
  missing = [f"{doc}: {m.group(1)}" for doc in DOCS for m in BARE.finditer(open(os.path.join(ROOT, doc)).read())
             if m.group(1) not in names]
  assert not missing, "named but under no folder of results/:\n" + "\n".join(missing)
