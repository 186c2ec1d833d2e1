"""PNG figures of simulated runs (``python -m reflow_hpc.sim CONFIG --plot DIR``):

- ``throughput.png``: throughput against GPUs, one line per mode;
- ``idle.png``: trainer and rollout idle ratios against GPUs, per mode;
- ``roles_<mode>_<gpus>.png``: the role timeline of one run (the paper's Fig. 14): per worker, when it
  generated, trained, synced, switched roles or idled.
"""

from __future__ import annotations

import io
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ..private import private_dir, write_atomic  # noqa: E402

MODE_STYLE = {"sync": ("tab:gray", "o"), "one_step_off": ("tab:blue", "s"), "fully_async": ("tab:orange", "^"),
              "reflow": ("tab:green", "D")}
ACTIVITY_COLOR = {"generate": "tab:green", "train": "tab:blue", "sync": "tab:purple", "switch": "tab:red",
                  "checkpoint": "tab:brown", "idle-rollout": "#dddddd", "idle-trainer": "#f2d7d5"}


def _save(fig, path: Path) -> None:
    """The PNG, replaced atomically: savefig to a path would write through a symlink planted there."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    write_atomic(path, buf.getvalue())


def scaling(rows: list[dict], out: Path, title: str) -> list[Path]:
    """throughput.png and idle.png from summaries of several modes and GPU counts."""
    private_dir(out, what="plot directory")
    modes = [m for m in MODE_STYLE if any(r["mode"] == m for r in rows)]
    paths = []
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for m in modes:
        pts = sorted((r["gpus"], r["throughput_tokens_per_s"]) for r in rows if r["mode"] == m)
        color, marker = MODE_STYLE[m]
        ax.plot([g for g, _ in pts], [t / 1e3 for _, t in pts], marker=marker, color=color, label=m)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("throughput (k tokens/s)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    paths.append(out / "throughput.png")
    _save(fig, paths[-1])
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(9.6, 3.8), sharey=True)
    for ax, key, label in ((axes[0], "idle_trainer", "trainer idle"), (axes[1], "idle_rollout", "rollout idle")):
        for m in modes:
            pts = sorted((r["gpus"], r[key]) for r in rows if r["mode"] == m)
            color, marker = MODE_STYLE[m]
            ax.plot([g for g, _ in pts], [v * 100 for _, v in pts], marker=marker, color=color, label=m)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("% of step time")
    axes[1].legend()
    fig.suptitle(title)
    fig.tight_layout()
    paths.append(out / "idle.png")
    _save(fig, paths[-1])
    plt.close(fig)
    return paths


def role_timeline(timeline: list, workers: int, out: Path, title: str, name: str) -> Path:
    """One bar per worker, coloured by activity over simulated time."""
    private_dir(out, what="plot directory")
    fig, ax = plt.subplots(figsize=(9.6, max(2.5, 0.22 * workers + 1.2)))
    by_kind: dict[str, list] = {}
    for a in timeline:
        by_kind.setdefault(a.kind, []).append(a)
    for kind, acts in by_kind.items():
        for w in sorted({a.worker for a in acts}):
            spans = [(a.start, a.end - a.start) for a in acts if a.worker == w]
            ax.broken_barh(spans, (w - 0.4, 0.8), color=ACTIVITY_COLOR.get(kind, "black"), label=kind)
    handles, labels = ax.get_legend_handles_labels()
    seen = {}
    for h, label in zip(handles, labels):
        seen.setdefault(label, h)
    ax.legend(seen.values(), seen.keys(), loc="upper right", fontsize=7, ncol=len(seen))
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("worker")
    ax.set_ylim(-0.8, workers - 0.2)
    ax.set_title(title)
    fig.tight_layout()
    path = out / name
    _save(fig, path)
    plt.close(fig)
    return path
