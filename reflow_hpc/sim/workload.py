"""What one simulated run is: the config of a mode, the placement of GPUs into workers, and the
coordinator built from them as the MPI runtime builds it (``runtime/training.py``).

A simulated **worker** is what the coordinator addresses. With ``sim.gpus = 0`` the placement is the
``[resources]`` split itself — one worker per rank, trainers first, as ``runtime.training.pools``
lays it out — so a CPU config runs unchanged. With ``sim.gpus = G > 0`` every worker stands for
``u`` GPUs (``sim.worker_gpus``; 0 picks the smallest multiple of ``s_R = resources.rollout_tp_size``
that keeps ``W = G/u ≤ sim.max_workers``). Uniform workers are what the elastic pool moves between
roles. A worker in the rollout role runs ``m = u/s_R`` engines of ``s_R`` GPUs, modelled as one pooled
engine (requests spread evenly: :mod:`reflow_hpc.sim.engine`); in the trainer role it is one trainer
replica of ``u`` GPUs.

- colocated modes (``sync``): all ``W`` workers generate, then all train their share of the batch;
- split modes: the first ``n_T = round(f·W)`` workers train (``f = sim.trainer_fraction``), the other
  ``W − n_T`` generate. The baselines keep this split; mode ``reflow`` may move workers at sync points
  (``scheduler.elastic``, the planner of :mod:`reflow_hpc.core.placement`).

The coordinator's settings come from :mod:`reflow_hpc.assembly`, as the MPI runtime's do; where the
simulated placement differs — a worker's slots are ``m × rollout.max_concurrency``, its KV budget
the pooled engine's, and the elastic pool's unit is one worker — it says so below. The simulator
keeps no event log (``run.event_log``): a million-sample run would hold every event in memory.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..config import Config, ConfigError, load
from ..assembly import coordinator_settings, new_coordinator
from ..core.coordinator import Coordinator, Settings
from ..core.modes import MODES, rules
from .costs import Costs

MODE_ORDER = tuple(MODES)          # sync, one_step_off, fully_async, reflow


@dataclass(frozen=True)
class Placement:
    """The workers of a run and what each stands for."""
    world: int                        # W
    trainers: tuple[int, ...]         # at the start (the elastic pool may change them)
    rollouts: tuple[int, ...]
    worker_gpus: int                  # u: GPUs per worker
    engines: int                      # m: rollout engines per worker (u / s_R)
    tp: int                           # s_R: GPUs per engine
    colocated: bool

    @property
    def total_gpus(self) -> int:
        return self.world * self.worker_gpus


def mode_overrides(mode: str) -> list[str]:
    """The overrides that make a run of ``mode`` a true instance of it (as ``tools/bench_modes.py``):
    baselines do not replay; the exact-staleness modes sync every step; batch-level modes dispatch
    one batch per step."""
    r = rules(mode)
    sets = [f"reflow.mode={mode}"]
    if not r.replays:
        sets.append("reflow.sigma=0")
    if r.exact_staleness is not None:
        sets.append("reflow.sync_every=1")
    if r.batch_level:
        sets.append("reflow.b_max=0")
    return sets


def load_mode(path: str | None, mode: str, overrides: list[str] = (), gpus: int | None = None) -> Config:
    """The config of one simulated run: the file, the mode's own settings, the user's overrides, then
    ``gpus`` (``--gpus``). With ``sim.gpus > 0`` the ``[resources]`` split is rewritten to the simulated
    workers (:func:`placement`: W workers, the first n_T training), so that what the config says of ranks —
    ``scheduler.placement_schedule`` counts trainer replicas among them — holds for the simulated ones."""
    sets = [*mode_overrides(mode), *overrides]
    if gpus is not None:
        sets.append(f"sim.gpus={gpus}")
    # First without the schedule: it is checked against the workers, which the placement decides.
    cfg = load(path, [*sets, "scheduler.placement_schedule=[]", "scheduler.min_trainers=1",
                      "scheduler.min_rollouts=1"], check_files=False)
    if cfg.sim.gpus:
        # The GPUs as ranks: n_T trainer replicas of u GPUs, and the rollout workers' engines as instances of s_R.
        place = placement(cfg)
        n_t = len(place.trainers) if not place.colocated else place.world
        n_r = 0 if place.colocated else len(place.rollouts) * place.engines
        sets = [f"resources.workers={place.total_gpus}", f"resources.trainer_replicas={n_t}",
                f"resources.trainer_shard_size={place.worker_gpus}", f"resources.rollout_instances={n_r}", *sets]
    cfg = load(path, sets, check_files=False) if cfg.sim.gpus or _has_schedule(path, sets) else cfg
    if cfg.reflow.mode != mode:
        raise ConfigError("reflow.mode", cfg.reflow.mode, f"the simulator was asked for mode {mode}")
    if cfg.sim.tick_s >= cfg.run.timeout_s:       # a simulated run's own rule: a real run has no such ticks
        raise ConfigError("sim.tick_s", cfg.sim.tick_s, f"must be < run.timeout_s ({cfg.run.timeout_s}): the "
                                                        f"simulated heartbeats keep every worker alive")
    return cfg


def _has_schedule(path: str | None, sets: list[str]) -> bool:
    """Whether the file or the overrides touch the keys the first load neutralised."""
    keys = ("placement_schedule", "min_trainers", "min_rollouts")
    if any(s.split("=", 1)[0].strip() in {f"scheduler.{k}" for k in keys} for s in sets):
        return True
    if path is None:
        return False
    import tomllib
    from pathlib import Path
    data = tomllib.loads(Path(path).read_text())
    return any(k in data.get("scheduler", {}) for k in keys)


def worker_gpus(cfg: Config) -> int:
    """u (module docstring)."""
    s, tp = cfg.sim, cfg.resources.rollout_tp_size
    if s.worker_gpus:
        return s.worker_gpus
    u = tp
    while s.gpus // u > s.max_workers:
        u += tp
    return u


def placement(cfg: Config) -> Placement:
    """The workers of the run (module docstring)."""
    colocated = rules(cfg.reflow.mode).colocated
    s, r = cfg.sim, cfg.resources
    if s.gpus == 0:
        w = r.workers
        n_t = w if colocated else r.trainer_replicas * r.trainer_shard_size
        trainers = tuple(range(w)) if colocated else tuple(range(n_t))
        rollouts = tuple(range(w)) if colocated else tuple(range(n_t, w))
        return Placement(w, trainers, rollouts, 1, 1, 1, colocated)
    tp = r.rollout_tp_size
    u = worker_gpus(cfg)
    if u % tp:
        raise ConfigError("sim.worker_gpus", u, f"must be a multiple of resources.rollout_tp_size ({tp})")
    w = s.gpus // u
    if w * u != s.gpus:
        raise ConfigError("sim.gpus", s.gpus, f"must be a multiple of the GPUs per worker ({u})")
    if colocated:
        ids = tuple(range(w))
        return Placement(w, ids, ids, u, u // tp, tp, True)
    if w < 2:
        raise ConfigError("sim.gpus", s.gpus, f"split pools need two workers of {u} GPU(s) at least")
    n_t = min(w - 1, max(1, round(s.trainer_fraction * w)))
    return Placement(w, tuple(range(n_t)), tuple(range(n_t, w)), u, u // tp, tp, False)


def build_coordinator(cfg: Config, place: Placement, costs: Costs | None = None, *,
                      check_invariants: bool = False) -> tuple[Coordinator, Settings]:
    """The coordinator of ``runtime.training.build_coordinator`` and its settings, on the simulated placement:
    the elastic pool's unit is one simulated worker (uniform by construction, so s_T = s_R = 1 here).
    ``check_invariants``: the index checks every invariant after every event (tests)."""
    costs = costs or Costs.from_config(cfg)
    kv_budget = int(place.engines * costs.kv_capacity(place.tp)) if cfg.sim.gpus else cfg.rollout.kv_budget_tokens
    settings = coordinator_settings(cfg, workers=place.world, replica_size=1, rollout_tp=1,
                                    cap_max=cfg.rollout.max_concurrency * place.engines, kv_budget=kv_budget,
                                    event_log=False)
    settings = dataclasses.replace(settings, check_invariants=check_invariants)
    return new_coordinator(cfg, settings, trainers=list(place.trainers), rollouts=list(place.rollouts),
                           world=place.world), settings
