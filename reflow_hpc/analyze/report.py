"""The analysis of one run directory: one streaming pass over each source, then a JSON-able result
and its text summary.

Sources and what each gives (a missing or damaged source is reported and its sections say so):

- ``shards/rank*/``, verified rows in chunks (:class:`~reflow_hpc.analyze.read.ShardWalk`): samples,
  finish reasons, reward and response length by policy version, tokens per worker, flush times.
- ``events.jsonl``, line by line: terminal reasons, samples evicted unused, staleness of trained
  samples (``compose``), times each sample was trained, loss tokens per worker per version, and the
  step and block skeleton of the what-if.
- ``metrics.jsonl``, line by line: idle ratio of trainers and rollout workers per step, each rank's
  role per step.
- ``topology.json``, ``summary.json``, whole (small): mode, ranks, the role timeline (placements),
  the run's own counters.

Per-version series (reward, response length) are keyed by a sample's oldest token version. Series in
the JSON object are merged into at most ``max_points`` bins of adjacent versions (count-weighted),
so its size does not grow with the run; plots use the full series.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from reflow_hpc.core.sample import TERMINAL_REASONS

from reflow_hpc.storage.reader import BUDGET_MIB

from .read import Flush, ShardWalk, Unreadable, iter_jsonl, read_json
from .stats import EVICTED_UNUSED_CAUSES, MAX_RANKS, ROLES, EventStats, MetricStats, ShardStats, Tally


@dataclass
class Sources:
    """What the passes over a run directory collected."""
    run_dir: Path
    shards: ShardStats
    events: EventStats | None          # None: no readable event log
    metrics: MetricStats
    summary: dict | None
    topology: dict | None
    segments: int = 0
    shards_from: str = "shards"
    flushes: list[Flush] = field(default_factory=list)
    bad: list[Unreadable] = field(default_factory=list)


def collect(run_dir: Path, *, chunk_rows: int, verify: bool = True, budget_mib: float = BUDGET_MIB) -> Sources:
    """One pass over every source of ``run_dir`` (module docstring); never raises for bad data."""
    bad: list[Unreadable] = []
    topology = read_json(run_dir / "topology.json", "topology.json", bad)
    topology = topology if isinstance(topology, dict) else None
    ranks = _get(topology, "ranks", list) or []
    scratch = list(dict.fromkeys(Path(r["scratch"]) / "shards" for r in ranks[:MAX_RANKS]
                                 if isinstance(r, dict) and isinstance(r.get("scratch"), str)))
    shards = ShardStats()
    walk = ShardWalk(run_dir, bad, chunk_rows=chunk_rows, verify=verify, scratch_dirs=scratch, budget_mib=budget_mib)
    for chunk in walk:
        shards.add(chunk.rows)
    events: EventStats | None = EventStats()
    for line, e in iter_jsonl(run_dir / "events.jsonl", "events.jsonl", bad):
        events.feed(line, e)
    if events.events == 0:
        events = None
    metrics = MetricStats()
    for line, r in iter_jsonl(run_dir / "metrics.jsonl", "metrics.jsonl", bad):
        metrics.feed(line, r)
    summary = read_json(run_dir / "summary.json", "summary.json", bad)
    return Sources(run_dir, shards, events, metrics, summary if isinstance(summary, dict) else None, topology,
                   walk.segments, walk.source, walk.flushes, bad)


# ------------------------------------------------------------------------------------------ result

def result(src: Sources, *, max_points: int) -> dict[str, Any]:
    """The JSON-able analysis (the keys of the ``--json`` object)."""
    sh, ev, me, summary = src.shards, src.events, src.metrics, src.summary or {}
    # summary.json and topology.json are data too: only fields of the expected type are used.
    mode = _get(summary, "mode", str) or _get(_get(_get(src.topology, "config", dict), "reflow", dict), "mode", str)
    steps = _get(summary, "steps", int)
    out: dict[str, Any] = {
        "run_dir": str(src.run_dir),
        "mode": mode[:64] if mode else None,
        "steps": steps if steps is not None else len(me.step),
        "ranks": _get(src.topology, "world_size", int),
        "samples": sh.samples,
        "segments": src.segments,
        "shards_from": src.shards_from,
        "unreadable": [u.to_json() for u in src.bad],
        "unreadable_samples": sum(u.samples or 0 for u in src.bad),      # only shard entries count samples
        "finish_reasons": dict(sorted(sh.finish_reasons.items())),
    }
    if ev is not None:
        out.update(created=ev.created, finished=ev.finished, failed=ev.failed,
                   by_reason=dict(sorted(ev.by_reason.items())), by_reason_from="events.jsonl",
                   evicted_unused=ev.evicted_unused, events=ev.events, resumed=ev.resumed,
                   evicted_unused_by_cause=dict(sorted(ev.evicted_unused_by_cause.items())))
    else:
        buf = {k: v for k, v in (_get(summary, "buffer", dict) or {}).items() if type(v) is int}
        out.update(created=buf.get("buffer/created"), finished=None, failed=buf.get("buffer/failed"),
                   by_reason={k[len("buffer/"):]: v for k, v in buf.items() if k[len("buffer/"):] in TERMINAL_REASONS},
                   by_reason_from="summary.json" if buf else None, evicted_unused=buf.get("buffer/evicted_unused"))
    out["staleness"] = _staleness(ev)
    out["replay_count"] = _replay_count(ev)
    out["reward_by_version"] = _by_version(sh.by_version, "reward", max_points)
    out["response_length"] = _lengths(sh, max_points)
    out["tokens_by_worker"] = {str(int(w)): {"samples": int(n), "tokens": int(t), "response_tokens": int(r)}
                               for w, (n, t, r) in enumerate(zip(sh.by_owner.get("samples"), sh.by_owner.get("tokens"),
                                                                 sh.by_owner.get("response"))) if n}
    out["idle"] = _idle(me)
    out["placement"] = _placement(me, max_points)
    out["roles"] = _roles(me, src.topology)
    if me.ignored_ranks:
        out["roles"]["ignored_ranks"] = me.ignored_ranks
    return out


def _get(d: Any, key: str, kind: type) -> Any:
    """``d[key]`` when ``d`` is a dict and the value a ``kind`` (a bool is no int), else None."""
    v = d.get(key) if isinstance(d, dict) else None
    return v if isinstance(v, kind) and not (kind is int and isinstance(v, bool)) else None


def _staleness(ev: EventStats | None) -> dict[str, Any] | None:
    if ev is None or not ev.steps:
        return None
    hist = {k: [int(c) for c in t.get("count")] for k, t in ev.staleness.items()}
    n = max(len(h) for h in hist.values())
    total = [sum(h[i] if i < len(h) else 0 for h in hist.values()) for i in range(n)]
    count = sum(total)
    return {"trained": count, "mean": sum(i * c for i, c in enumerate(total)) / count if count else None,
            "max": max((i for i, c in enumerate(total) if c), default=0),
            "hist": total, "hist_unused": hist["unused"], "hist_replay": hist["replay"]}


def _replay_count(ev: EventStats | None) -> dict[str, Any] | None:
    if ev is None:
        return None
    times = ev.times_trained()
    hist = np.bincount(times) if len(times) else np.zeros(1, np.int64)
    return {"samples": int(len(times)), "hist": [int(c) for c in hist],
            "mean": float(times.mean()) if len(times) else None}


def _coarsen(cols: dict[str, np.ndarray], max_points: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(first index of each bin, summed columns) with at most ``max_points`` bins of equal width."""
    n = max((len(c) for c in cols.values()), default=0)
    width = max(1, math.ceil(n / max_points))
    starts = np.arange(0, n, width)
    return starts, {name: np.add.reduceat(col, starts) if n else col for name, col in cols.items()}


def _by_version(t: Tally, what: str, max_points: int) -> dict[str, Any] | None:
    if len(t) == 0:
        return None
    cols = {name: t.get(name) for name in ("count", what, what + "2")}
    first = -1                                   # key k holds version k - 1 (ShardStats)
    if cols["count"][0] == 0:                    # no row without generated tokens: bins start at version 0
        cols, first = {name: col[1:] for name, col in cols.items()}, 0
    starts, cols = _coarsen(cols, max_points)
    n = cols["count"]
    ok = n > 0
    mean = cols[what][ok] / n[ok]
    std = np.sqrt(np.maximum(cols[what + "2"][ok] / n[ok] - mean ** 2, 0.0))
    return {"version": [int(k) + first for k in starts[ok]], "bin_versions": int(starts[1]) if len(starts) > 1 else 1,
            "n": [int(x) for x in n[ok]], "mean": [round(float(x), 6) for x in mean],
            "std": [round(float(x), 6) for x in std]}


def _percentile(hist: np.ndarray, q: float) -> int:
    cum = np.cumsum(hist)
    return int(np.searchsorted(cum, q * cum[-1])) if len(cum) and cum[-1] else 0


def _lengths(sh: ShardStats, max_points: int) -> dict[str, Any] | None:
    hist = sh.lengths.get("count")
    if not len(hist) or not hist.sum():
        return None
    total = hist.sum()
    keys, cols = _coarsen({"count": hist}, max_points)
    return {"mean": float((hist * np.arange(len(hist))).sum() / total), "p50": _percentile(hist, 0.5),
            "p90": _percentile(hist, 0.9), "p99": _percentile(hist, 0.99), "max": int(len(hist) - 1),
            "hist_from": [int(k) for k in keys], "hist": [int(c) for c in cols["count"]],
            "by_version": _by_version(sh.by_version, "length", max_points)}


def _idle(me: MetricStats) -> dict[str, Any] | None:
    if not me.step:
        return None
    idle_t, idle_r = np.array(me.idle_trainer), np.array(me.idle_rollout)
    by_rank = {}
    for rank, roles in sorted(me.roles.items()):
        idx = np.frombuffer(roles.steps, np.int64)
        codes = np.frombuffer(roles.codes, np.uint8)
        ratio = rank_idle(codes, idle_t[idx], idle_r[idx])
        by_rank[str(rank)] = None if np.isnan(ratio).all() else round(float(np.nanmean(ratio)), 4)
    return {"steps": len(me.step), "trainer_mean": _nanmean(idle_t), "rollout_mean": _nanmean(idle_r),
            "by_rank": by_rank}


def _placement(me: MetricStats, max_points: int) -> dict[str, Any] | None:
    """The planner's predicted against observed usable fresh coverage and step time, per step (None: no
    planner in the run)."""
    steps = [i for i, (p, _) in enumerate(me.coverage) if not math.isnan(p)]
    if not steps:
        return None
    pick = sorted(set(np.linspace(0, len(steps) - 1, min(max_points, len(steps))).round().astype(int).tolist()))

    def error(pairs: list[tuple[float, float]]) -> float | None:
        e = [abs(p / o - 1) for p, o in pairs if o and not (math.isnan(p) or math.isnan(o))]
        return round(float(np.median(e)), 4) if e else None

    late = steps[len(steps) // 4:]                  # after the first quarter: the rates have settled
    return {"steps": len(steps),
            "coverage_error": error([me.coverage[i] for i in late]),
            "step_error": error([(me.step_predicted[i], me.step_seconds[i]) for i in late]),
            "series": [{"step": me.step[steps[j]], "coverage": list(me.coverage[steps[j]]),
                        "step_s": [me.step_predicted[steps[j]], me.step_seconds[steps[j]]]} for j in pick]}


def rank_idle(codes: np.ndarray, idle_t: np.ndarray, idle_r: np.ndarray) -> np.ndarray:
    """Idle ratio of one rank per step: its role's idle ratio that step (both roles of a colocated
    worker: their mean, since it waits for a batch and for generation in turn)."""
    n = min(len(codes), len(idle_t))
    c, t, r = codes[:n], idle_t[:n], idle_r[:n]
    trainer, rollout, both = (c == ROLES.index(role) for role in ("trainer", "rollout", "trainer+rollout"))
    return np.where(trainer, t, np.where(rollout, r, np.where(both, (t + r) / 2, np.nan)))


def _roles(me: MetricStats, topology: dict | None) -> dict[str, Any]:
    by_rank = {}
    for rank, roles in sorted(me.roles.items()):
        counts = Counter(roles.codes)
        by_rank[str(rank)] = {ROLES[c]: n for c, n in sorted(counts.items()) if c}
    timeline = [{"step": p["step"], "trainer_replicas": p["trainer_replicas"]}
                for p in (_get(topology, "role_timeline", list) or [])[:10_000]
                if _get(p, "step", int) is not None and _get(p, "trainer_replicas", int) is not None]
    return {"steps_by_rank": by_rank, "timeline": timeline}


def _nanmean(x: np.ndarray) -> float | None:
    return None if not len(x) or np.isnan(x).all() else round(float(np.nanmean(x)), 4)


# -------------------------------------------------------------------------------------------- text

def text(res: dict[str, Any], *, rows: int) -> str:
    """The human summary of a result; ``rows``: lines shown of a per-version table."""
    out = [f"analysis of {res['run_dir']}"]
    out.append(f"run: mode {res.get('mode') or '?'}, {res.get('steps')} steps, {res.get('ranks') or '?'} ranks")
    created = res.get("created")
    where = "" if res["shards_from"] == "shards" else f" in {res['shards_from']}"
    finished = f", {res['finished']} finished" if res.get("finished") is not None else ""
    out.append(f"samples: {created if created is not None else '?'} created{finished}, {res['samples']} read from "
               f"{res['segments']} shard segments{where}, {res['unreadable_samples']} in unreadable rows")
    reasons = res.get("by_reason") or {}
    total = sum(reasons.values())
    if reasons:
        parts = [f"{k} {v} ({v / total:.1%})" for k, v in sorted(reasons.items(), key=lambda kv: -kv[1])]
        unused = res.get("evicted_unused")
        tail = f"; {unused} evicted stale never trained" if unused is not None else ""
        causes = res.get("evicted_unused_by_cause")
        if unused and causes:
            tail += " (" + ", ".join(f"{n} {EVICTED_UNUSED_CAUSES.get(k, k)}" for k, n in causes.items()) + ")"
        out.append(f"terminal reasons ({res.get('by_reason_from')}): " + ", ".join(parts) + tail)
    else:
        out.append("terminal reasons: no event log and no summary.json")
    if res["finish_reasons"]:
        out.append("finish reasons (shards): " + ", ".join(f"{k} {v}" for k, v in res["finish_reasons"].items()))
    st = res.get("staleness")
    if st:
        out.append(f"staleness of trained samples ({st['trained']}): mean {st['mean']:.2f}, max {st['max']}; "
                   + _hist(st["hist"], "") + f"  [replayed: {_hist(st['hist_replay'], '')}]")
    else:
        out.append("staleness: no compose events")
    rc = res.get("replay_count")
    if rc and rc["samples"]:
        out.append(f"times trained per finished sample ({rc['samples']}): mean {rc['mean']:.2f}; "
                   + _hist(rc["hist"], "×"))
    rv = res.get("reward_by_version")
    if rv:
        out.append("reward by policy version (oldest token): " + _series(rv, rows, "{:.3f}"))
    rl = res.get("response_length")
    if rl:
        bv = rl["by_version"]
        drift = f"; by version: {_series(bv, rows, '{:.1f}')}" if bv else ""
        out.append(f"response length: mean {rl['mean']:.1f}, p50 {rl['p50']}, p90 {rl['p90']}, p99 {rl['p99']}, "
                   f"max {rl['max']}{drift}")
    tw = res.get("tokens_by_worker") or {}
    if tw:
        out.append("tokens per worker (shards): " + ", ".join(f"rank {w} {d['tokens']} ({d['samples']} samples)"
                                                            for w, d in tw.items()))
    idle = res.get("idle")
    if idle:
        per = ", ".join(f"rank {r} {v:.0%}" for r, v in idle["by_rank"].items() if v is not None)
        out.append(f"idle over {idle['steps']} steps: trainer {_pct(idle['trainer_mean'])}, rollout "
                   f"{_pct(idle['rollout_mean'])}; by rank: {per or '-'}")
    else:
        out.append("idle: no step records in metrics.jsonl")
    pl = res.get("placement")
    if pl:
        series = ", ".join(f"{x['step']}: {_fmt(x['coverage'][0], '{:.1f}')}/{_fmt(x['coverage'][1], '{:.1f}')} "
                           f"{_fmt(x['step_s'][0], '{:.2f}')}/{_fmt(x['step_s'][1], '{:.2f}')} s" for x in pl["series"])
        out.append(f"placement planner, predicted/observed per step (usable fresh samples, step time): {series}; "
                   f"median error after the first quarter: coverage {_pct(pl['coverage_error'])}, step time "
                   f"{_pct(pl['step_error'])}")
    roles = res.get("roles") or {}
    if roles.get("steps_by_rank"):
        per = "; ".join(f"rank {r} " + ", ".join(f"{k} {n}" for k, n in d.items())
                        for r, d in roles["steps_by_rank"].items())
        tl = ", ".join(f"after step {p['step']}: {p['trainer_replicas']} trainer replica(s)" for p in roles["timeline"])
        out.append(f"roles (steps): {per}" + (f"; placements: {tl}" if tl else ""))
    if roles.get("ignored_ranks"):
        out.append(f"roles: {roles['ignored_ranks']} role/<rank> entries ignored (over {MAX_RANKS} ranks, or a rank "
                   f"out of range)")
    if res.get("plugins_not_imported"):
        out.append(f"plugins: the run's run.plugins names {', '.join(res['plugins_not_imported'])}: not imported "
                   f"(analyze imports only modules named with --plugin)")
    wi = res.get("what_if")
    if wi and wi.get("skipped"):
        out.append(f"what-if: skipped: {wi['skipped']}")
    elif wi:
        out += what_if_text(wi)
    bad = res["unreadable"]
    out.append(f"unreadable: {len(bad)}" + ("" if bad else " (none)"))
    out += ["  " + Unreadable.from_json(u).describe() for u in bad]
    if res.get("plots"):
        out.append("plots: " + ", ".join(res["plots"]))
    if res.get("plots_failed"):
        out.append("plots not drawn: " + "; ".join(res["plots_failed"]))
    return "\n".join(out)


def what_if_text(wi: dict[str, Any]) -> list[str]:
    outs = wi["outcomes"]
    rows = [("", lambda o: o["label"]),
            ("σ τ δ b_max", lambda o: "{sigma:g} {tau:g} {delta} {b_max}".format(**o["settings"])),
            ("sampler / filter", lambda o: f"{o['settings']['sampler']} / {o['settings']['replay_filter']}"),
            ("steps", lambda o: str(o["steps"])),
            ("replay fraction", lambda o: _fmt(o["replay_fraction"], "{:.3f}")),
            ("evicted unused", lambda o: f"{o['evicted_unused']} of {o['created']}"),
            ("staleness mean / max", lambda o: f"{_fmt(o['staleness_mean'], '{:.2f}')} / {o['staleness_max']}"),
            ("trainer waits", lambda o: "?" if o["trainer_waits"] is None else
             f"{o['trainer_waits']} ({o['steps_waited']} steps, {o['wait_s']:.1f} s)"),
            ("deferred dispatches", lambda o: str(o["deferred_groups"]))]
    cells = [[name] + [f(o) for o in outs] for name, f in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    lines = [f"what-if ({'overrides ' + ' '.join(wi['overrides']) if wi['overrides'] else 'no override'}; "
             f"config from {wi['config_from']}):"]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines += ["  " + n for n in wi.get("notes", [])]
    base = outs[1]
    verdict = "yes" if wi["reproduces_run"] else f"NO ({base.get('first_mismatch') or base.get('stopped')})"
    lines.append(f"  replay under the run's settings reproduces its {base['matched_steps']} batches: {verdict}")
    for o in outs[1:]:
        if o.get("stopped") and o is not base:
            lines.append(f"  {o['label']}: stopped at {o['stopped']}")
        if o.get("not_dispatched"):
            lines.append(f"  {o['label']}: {o['not_dispatched']} samples still waiting for dispatch at the end "
                         f"of the log")
    return lines


def _hist(h: list[int], suffix: str) -> str:
    total = sum(h)
    return "  ".join(f"{i}{suffix}: {c} ({c / total:.0%})" for i, c in enumerate(h) if c) if total else "-"


def _series(s: dict[str, Any], rows: int, fmt: str) -> str:
    """Up to ``rows`` evenly spaced entries of a per-version series."""
    n = len(s["version"])
    pick = sorted(set(np.linspace(0, n - 1, min(rows, n)).round().astype(int).tolist())) if n else []
    width = s.get("bin_versions", 1)
    label = (lambda v: f"v{v}") if width == 1 else (lambda v: f"v{v}–{v + width - 1}")
    return ", ".join(f"{label(s['version'][i])} {fmt.format(s['mean'][i])} ({s['n'][i]})" for i in pick)


def _fmt(v: Any, fmt: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"
