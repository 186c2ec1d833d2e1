"""``python -m reflow_hpc.analyze RUN_DIR``: the command line, and :func:`analyze_run` for programs.

Output: the text summary on stdout and in ``<out>/summary.txt``, the plots in ``<out>`` (default
``RUN_DIR/analysis``), the whole result as ``<out>/analysis.json``; with ``--json`` the same object
is also printed as the last line of stdout. Every output file is replaced through a private temp
file (:func:`reflow_hpc.private.write_atomic`): a symlink planted at its name is replaced, never
written through. Exit status 0 once the analysis ran, whatever data it found unreadable (a what-if
the data cannot support is skipped and says why); 2 for a usage error (no such directory, a
what-if key it cannot change, a ``--plugin`` that does not import) or an output it cannot write.

The run directory is read as data only: nothing in it is executed or imported. Plugins (modules of
``run.plugins``) are imported only when named with ``--plugin``; see :mod:`.whatif`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from reflow_hpc.private import UnsafePathError, private_dir, write_atomic
from reflow_hpc.storage.reader import BUDGET_MIB

from .report import collect, result, text
from .whatif import WHATIF_KEYS, WhatIf, WhatIfError, WhatIfSkipped, recorded_plugins

CHUNK_ROWS = 65536      # shard rows per read: ~4 MiB of row records, one h5py call per chunk
MAX_POINTS = 200        # bins of a per-version series in the JSON object
TABLE_ROWS = 8          # entries of a per-version series in the text summary


def analyze_run(run_dir: str | Path, out_dir: str | Path | None = None, *, what_if_overrides: list[str] | None = None,
                plots: bool = True, chunk_rows: int = CHUNK_ROWS, max_points: int = MAX_POINTS,
                table_rows: int = TABLE_ROWS, verify: bool = True, plugins: list[str] = (),
                budget_mib: float = BUDGET_MIB) -> tuple[dict[str, Any], str]:
    """Analyse ``run_dir``; returns (the JSON-able result, the text summary) and writes both (and the
    plots) into ``out_dir``. ``what_if_overrides``: None for no what-if, [] to replay under the run's
    own settings, or ``reflow.<key>=value`` strings. ``plugins``: modules the what-if may import
    (the run's own ``run.plugins`` are not imported unless named here). ``budget_mib``: most memory
    one shard read allocates. Raises :class:`WhatIfError` for a what-if asked for wrongly and
    FileNotFoundError for a missing directory; never for damaged data."""
    started = time.perf_counter()
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no such run directory")
    out = Path(out_dir) if out_dir is not None else run_dir / "analysis"
    config_bad: list = []
    notes: list[str] = []
    whatif, skipped = None, None
    if what_if_overrides is not None:
        try:
            whatif = WhatIf.prepare(run_dir, what_if_overrides, config_bad, list(plugins), notes)
        except WhatIfSkipped as e:
            skipped = str(e)
    src = collect(run_dir, chunk_rows=chunk_rows, verify=verify, budget_mib=budget_mib)
    src.bad += config_bad
    res = result(src, max_points=max_points)
    config = (src.topology or {}).get("config")
    res["plugins_not_imported"] = [m for m in recorded_plugins(config) if m not in plugins] \
        if isinstance(config, dict) else []
    if whatif is not None and src.events is None:
        skipped = "it needs the event log (events.jsonl), which is missing or unreadable"
    if skipped is not None:
        res["what_if"] = {"skipped": skipped, "overrides": list(what_if_overrides or [])}
        res["reproduces_run"] = None
    elif whatif is not None:
        res["what_if"] = whatif.run(src.events)
        res["what_if"]["notes"] = notes
        res["reproduces_run"] = res["what_if"]["reproduces_run"]
    res["plots"] = []
    if plots:
        from .plots import write_all
        res["plots"] = write_all(src, res, out)
    res["seconds"] = round(time.perf_counter() - started, 3)
    res["peak_rss_mib"] = round(_peak_rss_mib(), 1)
    res = _finite(res)
    summary = text(res, rows=table_rows)
    private_dir(out, what="analysis directory")
    write_atomic(out / "summary.txt", summary + "\n")
    write_atomic(out / "analysis.json", json.dumps(res, indent=1) + "\n")
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
        description="Analyse a run directory (shards, event log, metrics): text summary, PNG plots, what-if replay. "
                    "The directory is read as data: nothing in it is imported or run.")
    ap.add_argument("run_dir", help="the run directory (run.output_dir/run.name)")
    ap.add_argument("--out", help="where the plots, summary.txt and analysis.json go (default RUN_DIR/analysis)")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON object on the last line")
    ap.add_argument("--what-if", dest="what_if", action="extend", nargs="*", metavar="KEY=VALUE",
                    help="replay the run's arrival stream through the replay-buffer index with these settings "
                         f"({', '.join(WHATIF_KEYS)}); with no KEY=VALUE, under the run's own settings. "
                         "Reports reproduces_run: whether the replay under the run's settings composed every "
                         "recorded batch")
    ap.add_argument("--plugin", dest="plugins", action="append", default=[], metavar="MODULE",
                    help="import this module for the what-if (repeatable): the run's run.plugins are never "
                         "imported from its directory; one not named here is reported, and a what-if that needs "
                         "it (the run's sampler or replay filter) is skipped")
    ap.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    ap.add_argument("--no-verify", action="store_true",
                    help="trust the shards' token checksums without reading the token data (row checksums "
                         "and extents are still checked)")
    ap.add_argument("--chunk-rows", type=int, default=CHUNK_ROWS, help="shard rows read at a time (memory bound)")
    ap.add_argument("--read-budget-mib", type=float, default=BUDGET_MIB,
                    help="most memory one shard read allocates; a batch larger than this is reported, not read "
                         "(default: storage.read_budget_mib's default)")
    args = ap.parse_args(argv)
    if not args.read_budget_mib > 0:
        ap.error(f"--read-budget-mib {args.read_budget_mib}: must be > 0")
    try:
        res, summary = analyze_run(args.run_dir, args.out, what_if_overrides=args.what_if, plots=not args.no_plots,
                                   chunk_rows=args.chunk_rows, verify=not args.no_verify, plugins=args.plugins,
                                   budget_mib=args.read_budget_mib)
    except (WhatIfError, FileNotFoundError, ValueError, UnsafePathError) as e:
        print(f"analyze: {e}", file=sys.stderr)
        return 2
    except OSError as e:                # the output directory or a file in it cannot be written
        print(f"analyze: {e.filename or args.out or args.run_dir}: cannot write: {e.strerror or e}", file=sys.stderr)
        return 2
    print(summary)
    if args.json:
        print(json.dumps(res, separators=(",", ":")))
    return 0
