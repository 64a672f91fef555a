"""Published numbers beside ours: each row's change from the reference row, in the paper and here, and whether
the two point the same way. Both metrics are lower-is-better (perplexity there, bits per byte here), so only
the directions and their order compare, not the values."""

from __future__ import annotations

import math

PAPER_TIE = 0.005  # a published change under 0.5% of the reference's value counts as no change (one run each)


def _direction(delta: float, tie: float) -> str:
  if math.isnan(delta):
    return "?"
  return "≈" if abs(delta) <= tie else ("worse" if delta > 0 else "better")


def pooled_std(ours: dict) -> tuple:
  """(s, dof): the per-seed standard deviation pooled over every model with two or more seeds (ddof 1), and its
  degrees of freedom; (nan, 0) when no model has two. ours: model -> the per-seed values."""
  ss, dof = 0.0, 0
  for v in ours.values():
    v = [x for x in v if not math.isnan(x)]
    if len(v) > 1:
      m = sum(v) / len(v)
      ss += sum((x - m) ** 2 for x in v)
      dof += len(v) - 1
  return (math.sqrt(ss / dof), dof) if dof else (math.nan, 0)


def _mean_std(values) -> tuple:
  """(mean, std with ddof 0, n) of the values that are not NaN; (nan, nan, 0) where none is."""
  v = [x for x in values if not math.isnan(x)]
  if not v:
    return math.nan, math.nan, 0
  m = sum(v) / len(v)
  return m, math.sqrt(sum((x - m) ** 2 for x in v) / len(v)), len(v)


def table(spec, ours: dict, metric: str) -> list:
  """Markdown lines. ours: model -> the per-seed values of `metric` (each seed at its best rate). Our change is
  "≈" when it is within two standard errors of the difference of the two seed means, with one per-seed
  standard deviation pooled over every model of the table (`pooled_std`: the runs of one protocol share one
  noise level, so a model run with one seed still gets an estimate); the paper's when within PAPER_TIE of its
  reference."""
  ref, pub = spec["reference"], spec["values"]
  sd, dof = pooled_std(ours)
  noise = (f"ours: two standard errors of the difference of seed means, the per-seed standard deviation "
           f"{sd:.4f} pooled over the models with two or more seeds ({dof} degrees of freedom)" if dof else
           "ours: no model has two seeds yet, so no noise estimate")
  lines = [f"{spec['source']}. Published metric: {spec['metric']}; ours: `{metric}`; both lower is better. "
           f"Change from `{ref}`; ≈: within the noise (paper: {PAPER_TIE:.1%} of the reference; {noise}).", "",
           "| model | published | published change | ours | our change | agree? |", "|---|---|---|---|---|---|"]

  def stats(model):
    return _mean_std(ours.get(model, ()))

  r_mean, _, r_n = stats(ref)
  for model in [ref] + [m for m in pub if m != ref]:
    value = pub[model]
    p_delta = value - pub[ref]
    p_dir = _direction(p_delta, PAPER_TIE * abs(pub[ref]))
    mean, std, n = stats(model)
    o_delta = mean - r_mean
    se = sd * math.sqrt(1 / n + 1 / r_n) if dof and n and r_n else 0.0
    o_dir = _direction(o_delta, 2 * se)
    if model == ref:
      agree = "(reference)"
    elif "?" in (o_dir, p_dir):
      agree = "not run"
    elif "≈" in (o_dir, p_dir):
      agree = "agrees" if o_dir == p_dir else "tie on one side"
    else:
      agree = "agrees" if o_dir == p_dir else "**disagrees**"
    if model != ref and agree != "not run":
      if not se:
        agree += " (no noise estimate)"
      elif min(n, r_n) == 1:
        agree += " (one seed)"
    ours_text = "–" if math.isnan(mean) else f"{mean:.3f} ± {std:.3f} (n={n})"
    changes = ("", "") if model == ref else (f"{p_delta:+.2f} {p_dir}",
                                              "" if math.isnan(o_delta) else f"{o_delta:+.3f} {o_dir}")
    lines.append(f"| {model} | {value:g} | {changes[0]} | {ours_text} | {changes[1]} | {agree} |")
  return lines


def split_table(spec, ours: dict, metric: str, splits) -> list:
  """Markdown lines for a spec with `by_split` (model -> {eval split: published value}, on our metric's scale):
  for each published model, its row of ours (mean ± std over seeds at their best rates) and the paper's row,
  one column per eval split that the paper reports. ours: model -> split -> the per-seed values."""
  pub = spec["by_split"]
  cols = [sp for sp in splits if any(sp in v for v in pub.values())]
  lines = [f"{spec['source']}. Published metric: {spec['metric']}, shown on the scale of ours (`{metric}`); "
           "ours: mean ± std over seeds (n).", "",
           "| model | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
  for model, values in pub.items():
    cells = []
    for sp in cols:
      m, sd, n = _mean_std(ours.get(model, {}).get(sp, ()))
      cells.append(f"{m:.3f} ± {sd:.3f} ({n})" if n else "–")
    lines.append(f"| {model} | " + " | ".join(cells) + " |")
    lines.append(f"| {model} (paper) | " + " | ".join(f"{values[sp]:.3f}" if sp in values else "–" for sp in cols)
                 + " |")
  return lines
