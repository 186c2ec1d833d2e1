"""``python -m reflow_hpc.analyze RUN_DIR``: the command line, and :func:`analyze_run` for programs.

Output: the text summary on stdout and in ``<out>/summary.txt``, the plots in ``<out>`` (default
``RUN_DIR/analysis``), the whole result as ``<out>/analysis.json``; with ``--json`` the same object
is also printed as the last line of stdout. Exit status 0 once the analysis ran, whatever data it
found unreadable; 2 for a usage error (no such directory, a what-if key it cannot change).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from .report import collect, result, text
from .whatif import WHATIF_KEYS, WhatIf, WhatIfError

CHUNK_ROWS = 65536      # shard rows per read: ~4 MiB of row records, one h5py call per chunk
MAX_POINTS = 200        # bins of a per-version series in the JSON object
TABLE_ROWS = 8          # entries of a per-version series in the text summary


def analyze_run(run_dir: str | Path, out_dir: str | Path | None = None, *, what_if_overrides: list[str] | None = None,
                plots: bool = True, chunk_rows: int = CHUNK_ROWS, max_points: int = MAX_POINTS,
                table_rows: int = TABLE_ROWS, verify: bool = True) -> tuple[dict[str, Any], str]:
    """Analyse ``run_dir``; returns (the JSON-able result, the text summary) and writes both (and the
    plots) into ``out_dir``. ``what_if_overrides``: None for no what-if, [] to replay under the run's
    own settings, or ``reflow.<key>=value`` strings. Raises :class:`WhatIfError` for a what-if it
    cannot run and FileNotFoundError for a missing directory; never for damaged data."""
    started = time.perf_counter()
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no such run directory")
    out = Path(out_dir) if out_dir is not None else run_dir / "analysis"
    config_bad: list = []
    whatif = WhatIf.prepare(run_dir, what_if_overrides, config_bad) if what_if_overrides is not None else None
    src = collect(run_dir, chunk_rows=chunk_rows, verify=verify)
    src.bad += config_bad
    res = result(src, max_points=max_points)
    if whatif is not None:
        if src.events is None:
            raise WhatIfError("--what-if needs the event log (events.jsonl), which is missing or unreadable")
        res["what_if"] = whatif.run(src.events)
        res["reproduces_run"] = res["what_if"]["reproduces_run"]
    res["plots"] = []
    if plots:
        from .plots import write_all
        res["plots"] = write_all(src, res, out)
    res["seconds"] = round(time.perf_counter() - started, 3)
    res["peak_rss_mib"] = round(_peak_rss_mib(), 1)
    res = _finite(res)
    summary = text(res, rows=table_rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.txt").write_text(summary + "\n")
    (out / "analysis.json").write_text(json.dumps(res, indent=1) + "\n")
    return res, summary


def _peak_rss_mib() -> float:
    """This process's peak resident memory (Linux reports KiB; macOS bytes)."""
    import resource
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2 ** 20 if sys.platform == "darwin" else 1024)


def _finite(x: Any) -> Any:
    """The result with NaN and infinities as None (JSON has neither)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m reflow_hpc.analyze",
        description="Analyse a run directory (shards, event log, metrics): text summary, PNG plots, what-if replay.")
    ap.add_argument("run_dir", help="the run directory (run.output_dir/run.name)")
    ap.add_argument("--out", help="where the plots, summary.txt and analysis.json go (default RUN_DIR/analysis)")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON object on the last line")
    ap.add_argument("--what-if", dest="what_if", action="extend", nargs="*", metavar="KEY=VALUE",
                    help="replay the run's arrival stream through the replay-buffer index with these settings "
                         f"({', '.join(WHATIF_KEYS)}); with no KEY=VALUE, under the run's own settings. "
                         "Reports reproduces_run: whether the replay under the run's settings composed every "
                         "recorded batch")
    ap.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    ap.add_argument("--no-verify", action="store_true",
                    help="trust the shards' token checksums without reading the token data (row checksums "
                         "and extents are still checked)")
    ap.add_argument("--chunk-rows", type=int, default=CHUNK_ROWS, help="shard rows read at a time (memory bound)")
    args = ap.parse_args(argv)
    try:
        res, summary = analyze_run(args.run_dir, args.out, what_if_overrides=args.what_if, plots=not args.no_plots,
                                   chunk_rows=args.chunk_rows, verify=not args.no_verify)
    except (WhatIfError, FileNotFoundError, ValueError) as e:
        print(f"analyze: {e}", file=sys.stderr)
        return 2
    print(summary)
    if args.json:
        print(json.dumps(res, separators=(",", ":")))
    return 0
