"""How an objective's summed metrics become the means it logs: each over the units the sums were taken over (the
step's, or the held-out set's), or over the sum of another metric the objective names in its `metric_units` (KTO's
rewards of desirable samples, over its desirable samples)."""

from __future__ import annotations

from collections.abc import Mapping


def unit_means(sums: Mapping[str, float], units: float, over: Mapping[str, str]) -> dict[str, float]:
    """Each metric's sum divided by `units`, or by the sum of the metric `over` names for it; left out where that is
    0 (a step without a sample of that kind has no mean for it, not a mean of 0)."""
    means = {}
    for name, value in sums.items():
        count = sums[over[name]] if name in over else max(units, 1)
        if count:
            means[name] = value / count
    return means
