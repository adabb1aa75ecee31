"""`optc compare`: pass ablations of one recipe (quality, speed, size and build cost side by side).

variants (recipe edits, validated) -> cache (builds keyed by recipe and source hashes) -> measure
(optc.commands.eval windows, optc.commands.bench repeats) -> verdicts (intervals, noise bands, Pareto front, gate) ->
report (compare.json, compare.md, report.html) and plots (PNG).
"""

from optc.commands.compare.measure import SpeedSettings
from optc.commands.compare.run import CompareOptions, CompareResult, run_compare
from optc.commands.compare.variants import Mode

__all__ = ["CompareOptions", "CompareResult", "Mode", "SpeedSettings", "run_compare"]
