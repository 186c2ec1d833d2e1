"""PNG plots of an analysis (matplotlib, Agg backend: no display needed).

One file per question of the report; a plot whose source is missing is not written (the text
summary says why). Every function takes the collected :class:`~reflow_hpc.analyze.report.Sources`
(full-resolution series) and returns the path written or None.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Callable

import numpy as np

from reflow_hpc.private import private_dir, write_atomic

from .report import Sources, rank_idle
from .stats import ROLES

DPI = 110                     # ~900 px wide at the figure sizes below: readable, small files
FIGSIZE = (8.0, 4.0)
ROLE_COLOURS = ("#ffffff", "#d62728", "#1f77b4", "#9467bd", "#bbbbbb")   # in ROLES order
MAX_CELLS = 1 << 24           # ranks × steps of a per-rank image: beyond it the image is not drawn


def write_all(src: Sources, res: dict[str, Any], out_dir: Path) -> list[str]:
    """Every plot whose data exists, into ``out_dir``; returns the paths written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    private_dir(out_dir, what="plot directory")
    written = []
    makers: list[tuple[str, Callable]] = [
        ("terminal_reasons.png", _reasons), ("staleness.png", _staleness), ("replay_count.png", _replay_count),
        ("reward_by_version.png", _reward), ("response_length.png", _lengths),
        ("tokens_per_worker.png", _tokens), ("idle_by_rank.png", _idle), ("roles.png", _roles)]
    for name, make in makers:
        path = out_dir / name
        try:
            fig = make(plt, src, res)
            if fig is None:
                continue
            fig.tight_layout()
            png = io.BytesIO()
            fig.savefig(png, dpi=DPI, format="png")
        except Exception as e:      # data that passed every check and still breaks a plot costs that plot only
            res.setdefault("plots_failed", []).append(f"{name}: {e.__class__.__name__}: {str(e)[:200]}")
            continue
        finally:
            plt.close("all")
        write_atomic(path, png.getvalue())      # a symlink planted at the name is replaced, not written through
        written.append(str(path))
    return written


def _role_grid(me, n: int) -> tuple[list[int], np.ndarray] | None:
    """(ranks, their role codes over the first ``n`` steps), or None when the image would be too large."""
    ranks = sorted(me.roles)
    if not ranks or len(ranks) * n > MAX_CELLS:
        return None
    return ranks, np.array([me.roles[r].dense(n) for r in ranks])


def _reasons(plt, src: Sources, res: dict) -> Any:
    reasons, finish = res.get("by_reason") or {}, res.get("finish_reasons") or {}
    if not reasons and not finish:
        return None
    fig, axes = plt.subplots(1, 2, figsize=FIGSIZE)
    for ax, data, title in ((axes[0], reasons, f"terminal reason ({res.get('by_reason_from')})"),
                            (axes[1], finish, "how generation ended (shards)")):
        ax.bar(list(data), list(data.values()), color="#4c72b0")
        ax.set_title(title)
        ax.set_ylabel("samples")
        ax.tick_params(axis="x", rotation=30)
    return fig


def _staleness(plt, src: Sources, res: dict) -> Any:
    st = res.get("staleness")
    if not st:
        return None
    fig, ax = plt.subplots(figsize=FIGSIZE)
    n = len(st["hist"])
    unused = np.pad(st["hist_unused"], (0, n - len(st["hist_unused"])))
    replay = np.pad(st["hist_replay"], (0, n - len(st["hist_replay"])))
    x = np.arange(n)
    ax.bar(x, unused, label="unused", color="#4c72b0")
    ax.bar(x, replay, bottom=unused, label="replay", color="#dd8452")
    ax.set_xlabel("staleness when trained (optimizer steps)")
    ax.set_ylabel("trained samples")
    ax.set_xticks(x)
    ax.set_title(f"staleness of trained samples: mean {st['mean']:.2f}, max {st['max']}")
    ax.legend()
    return fig


def _replay_count(plt, src: Sources, res: dict) -> Any:
    rc = res.get("replay_count")
    if not rc or not rc["samples"]:
        return None
    fig, ax = plt.subplots(figsize=FIGSIZE)
    x = np.arange(len(rc["hist"]))
    ax.bar(x, rc["hist"], color="#55a868")
    ax.set_xticks(x)
    ax.set_xlabel("times trained")
    ax.set_ylabel("finished samples")
    ax.set_title(f"replay count: mean {rc['mean']:.2f} over {rc['samples']} finished samples")
    return fig


def _version_series(t, what: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    n = t.get("count")
    ok = n > 0
    mean = t.get(what)[ok] / n[ok]
    std = np.sqrt(np.maximum(t.get(what + "2")[ok] / n[ok] - mean ** 2, 0.0))
    return np.flatnonzero(ok) - 1, mean, std, n[ok]


def _reward(plt, src: Sources, res: dict) -> Any:
    t = src.shards.by_version
    if not len(t) or not t.get("count").sum():
        return None
    v, mean, std, n = _version_series(t, "reward")
    fig, ax = plt.subplots(figsize=FIGSIZE)
    ax.plot(v, mean, color="#4c72b0", label="mean reward")
    ax.fill_between(v, mean - std, mean + std, color="#4c72b0", alpha=0.2, label="± std")
    ax.set_xlabel("policy version (oldest token of the sample)")
    ax.set_ylabel("reward")
    ax2 = ax.twinx()
    ax2.plot(v, n, color="#999999", lw=0.8, label="samples")
    ax2.set_ylabel("samples", color="#999999")
    ax.set_title("reward by policy version (shards)")
    ax.legend(loc="upper left")
    return fig


def _lengths(plt, src: Sources, res: dict) -> Any:
    rl = res.get("response_length")
    if not rl:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(FIGSIZE[0] * 1.4, FIGSIZE[1]))
    hist = src.shards.lengths.get("count")
    a.bar(np.arange(len(hist)), hist, width=1.0, color="#4c72b0")
    a.set_xlabel("response tokens (incl. tool observations)")
    a.set_ylabel("samples")
    a.set_title(f"response length: mean {rl['mean']:.1f}, p50 {rl['p50']}, p90 {rl['p90']}")
    v, mean, std, _ = _version_series(src.shards.by_version, "length")
    b.plot(v, mean, color="#dd8452")
    b.fill_between(v, mean - std, mean + std, color="#dd8452", alpha=0.2)
    b.set_xlabel("policy version")
    b.set_ylabel("response tokens")
    b.set_title("drift: mean ± std by version")
    return fig


def _tokens(plt, src: Sources, res: dict) -> Any:
    """Cumulative loss tokens per worker against time: from ``finish`` events (tokens finished while
    the trainer was at each version, placed at the time it reached it), else from the shards' flush
    times (prompt + response tokens)."""
    ev = src.events
    fig, ax = plt.subplots(figsize=FIGSIZE)
    reached = [] if ev is None or ev.first_t is None else [s.train_t for s in ev.steps if s.train_t is not None]
    if ev is not None and ev.tokens_by_worker and ev.first_t is not None and \
            len(ev.tokens_by_worker) * (len(reached) + 1) <= MAX_CELLS:
        t0 = ev.starts[0][1] if ev.starts else ev.first_t
        reached = [t0] + reached                  # time version v was reached
        for w, by_version in sorted(ev.tokens_by_worker.items()):
            n = min(max(by_version) + 1, len(reached))
            tok = np.zeros(n)
            for v, x in by_version.items():
                if v < n:
                    tok[v] += x
            ax.step(np.array(reached[:n]) - t0, np.cumsum(tok), where="post", label=f"rank {w}")
        ax.set_ylabel("loss tokens finished (cumulative)")
        ax.set_title("tokens per worker over time (event log)")
    elif src.flushes:
        t0 = min(f.unix_time for f in src.flushes)
        for w in sorted({f.owner for f in src.flushes}):
            fl = sorted((f.unix_time, f.tokens) for f in src.flushes if f.owner == w)
            ax.step([t - t0 for t, _ in fl], np.cumsum([n for _, n in fl]), where="post", label=f"rank {w}")
        ax.set_ylabel("tokens flushed (cumulative)")
        ax.set_title("tokens per worker over time (shard flushes)")
    else:
        return None
    ax.set_xlabel("seconds since start")
    ax.legend(fontsize="small")
    return fig


def _idle(plt, src: Sources, res: dict) -> Any:
    me = src.metrics
    if not me.step:
        return None
    idle_t, idle_r = np.array(me.idle_trainer), np.array(me.idle_rollout)
    ranks = sorted(me.roles)
    fig, (a, b) = plt.subplots(2, 1, figsize=(FIGSIZE[0], FIGSIZE[1] * 1.6), sharex=True,
                               gridspec_kw={"height_ratios": [1, max(1, len(ranks)) ** 0.5]})
    a.plot(me.step, idle_t, label="trainer", color="#d62728")
    a.plot(me.step, idle_r, label="rollout", color="#1f77b4")
    a.set_ylabel("idle ratio")
    a.set_ylim(-0.02, 1.02)
    a.legend(fontsize="small")
    a.set_title("idle ratio per step: by pool (top), by rank in its role (bottom)")
    roles = _role_grid(me, len(me.step))
    if roles:
        ranks = roles[0]
        grid = np.array([rank_idle(codes, idle_t, idle_r) for codes in roles[1]])
        im = b.imshow(grid, aspect="auto", interpolation="nearest", cmap="magma_r", vmin=0, vmax=1,
                      extent=(me.step[0] - 0.5, me.step[-1] + 0.5, len(ranks) - 0.5, -0.5))
        b.set_yticks(range(len(ranks)), [str(r) for r in ranks])
        fig.colorbar(im, ax=b, label="idle ratio")
    b.set_ylabel("rank")
    b.set_xlabel("step")
    return fig


def _roles(plt, src: Sources, res: dict) -> Any:
    me = src.metrics
    if not me.roles:
        return None
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    roles = _role_grid(me, len(me.step))
    if roles is None:
        return None
    ranks, grid = roles
    fig, ax = plt.subplots(figsize=(FIGSIZE[0], 1.0 + 0.35 * len(ranks)))
    ax.imshow(grid, aspect="auto", interpolation="nearest", cmap=ListedColormap(ROLE_COLOURS), vmin=0,
              vmax=len(ROLES) - 1, extent=(me.step[0] - 0.5, me.step[-1] + 0.5, len(ranks) - 0.5, -0.5))
    for p in (res.get("roles") or {}).get("timeline", []):
        ax.axvline(p["step"] + 0.5, color="black", lw=0.8, ls="--")
    ax.set_yticks(range(len(ranks)), [str(r) for r in ranks])
    ax.set_ylabel("rank")
    ax.set_xlabel("step")
    used = sorted({int(c) for c in np.unique(grid)} - {0})
    ax.legend(handles=[Patch(color=ROLE_COLOURS[c], label=ROLES[c]) for c in used], fontsize="small",
              loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title("role of each rank per step (dashed: placement changes)")
    return fig
