"""Offline analysis of a run directory: ``python -m reflow_hpc.analyze RUN_DIR [--out DIR] [--json]
[--what-if key=value ...]``.

It reads what a finished or crashed run left behind — the shards (``shards/rank*/``, plain HDF5,
docs/storage.md), the event log (``events.jsonl``), the step metrics (``metrics.jsonl``),
``summary.json`` and ``topology.json`` — streaming with bounded memory, and writes a text summary
plus PNG plots. Bad data never stops it: whatever cannot be read is named (file, rows or lines, why),
counted and skipped.

Modules: :mod:`~reflow_hpc.analyze.read` (streaming readers that report bad data),
:mod:`~reflow_hpc.analyze.stats` (the accumulators of one pass), :mod:`~reflow_hpc.analyze.report`
(the result and its text), :mod:`~reflow_hpc.analyze.plots`, :mod:`~reflow_hpc.analyze.whatif` (the
recorded arrival stream replayed through the real replay-buffer index under other settings) and
:mod:`~reflow_hpc.analyze.cli`.
"""

from reflow_hpc.analyze.cli import analyze_run, main

__all__ = ["analyze_run", "main"]
