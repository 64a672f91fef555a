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


def table(spec, ours: dict, metric: str) -> list:
  """Markdown lines. ours: model -> (mean, std, seeds) of `metric`. Our change is "≈" when it is within two
  standard errors of a difference of means over seeds (std / sqrt(seeds) each), the paper's when within
  PAPER_TIE of its reference."""
  ref, pub = spec["reference"], spec["values"]
  lines = [f"{spec['source']}. Published metric: {spec['metric']}; ours: `{metric}`; both lower is better. "
           f"Change from `{ref}`; ≈: within the noise (paper: {PAPER_TIE:.1%} of the reference; ours: two standard "
           f"errors over seeds).", "",
           "| model | published | published change | ours | our change | agree? |", "|---|---|---|---|---|---|"]
  r_mean, r_std, r_n = ours.get(ref, (math.nan, math.nan, 0))
  for model in [ref] + [m for m in pub if m != ref]:
    value = pub[model]
    p_delta = value - pub[ref]
    p_dir = _direction(p_delta, PAPER_TIE * abs(pub[ref]))
    mean, std, n = ours.get(model, (math.nan, math.nan, 0))
    o_delta = mean - r_mean
    se = math.sqrt(std ** 2 / max(n, 1) + r_std ** 2 / max(r_n, 1)) if n > 1 and r_n > 1 else 0.0
    o_dir = _direction(o_delta, 2 * se)
    if model == ref:
      agree = "(reference)"
    elif "?" in (o_dir, p_dir):
      agree = "not run"
    elif "≈" in (o_dir, p_dir):
      agree = "agrees" if o_dir == p_dir else "tie on one side"
    else:
      agree = "agrees" if o_dir == p_dir else "**disagrees**"
    if model != ref and agree != "not run" and not se:
      agree += " (one seed: no noise estimate)"
    ours_text = "–" if math.isnan(mean) else f"{mean:.3f} ± {std:.3f} (n={n})"
    changes = ("", "") if model == ref else (f"{p_delta:+.2f} {p_dir}",
                                              "" if math.isnan(o_delta) else f"{o_delta:+.3f} {o_dir}")
    lines.append(f"| {model} | {value:g} | {changes[0]} | {ours_text} | {changes[1]} | {agree} |")
  return lines
