"""The coordinator a config describes: the one translation of ``[reflow]``, ``[scheduler]``, ``[trainer]``,
``[run]`` and ``[checkpoint]`` into :mod:`reflow_hpc.core`'s settings, shared by the two drivers of the
coordinator (the MPI runtime and the simulator), so that both run exactly the same rules.

The baselines keep a static split and fixed caps by definition (DESIGN §9): the elastic pool and
adaptive generation scheduling apply to mode ``reflow`` only.
"""

from __future__ import annotations

from typing import Callable

from .config import Config, dynamic_sampling, fresh_filter, objective_traits
from .core.coordinator import Coordinator, Settings
from .core.index import ReplayIndex, build_index
from .core.modes import rules
from .core.placement import PlacementSettings
from .core.scheduling import SchedulingSettings


def coordinator_settings(cfg: Config, *, workers: int | None = None, replica_size: int | None = None,
                         rollout_tp: int | None = None, cap_max: int | None = None, kv_budget: int | None = None,
                         event_log: bool | None = None) -> Settings:
    """The coordinator's settings; a driver whose workers are not the config's ranks (the simulator's stand
    for several GPUs each) passes their count, shapes, slots and KV budget."""
    sch, res = cfg.scheduler, cfg.resources
    reflow = cfg.reflow.mode == "reflow"
    replica_size = replica_size if replica_size is not None else res.trainer_shard_size
    scheduling = SchedulingSettings(
        adaptive=reflow and sch.adaptive, ema_alpha=sch.ema_alpha, control_interval_s=sch.control_interval_s,
        util_low=sch.util_low, util_high=sch.util_high, preemption_limit=sch.preemption_limit,
        increase=sch.cap_increase, decrease=sch.cap_decrease, cap_min=sch.cap_min, rho=sch.rho,
        queue=sch.queue_samples, initial_tokens=sch.initial_tokens)
    placement = PlacementSettings(
        elastic=True, workers=workers if workers is not None else res.workers,
        replica_size=replica_size,
        rollout_tp=rollout_tp if rollout_tp is not None else res.rollout_tp_size,
        min_trainers=sch.min_trainers, min_rollouts=sch.min_rollouts, batch_size=cfg.trainer.batch_size,
        sigma=cfg.reflow.sigma, ema_alpha=sch.placement_ema, cooldown_steps=sch.cooldown_steps,
        margin=sch.placement_margin, starve_idle=sch.starve_idle,
        switch_cost_s=sch.switch_cost_s, delta=cfg.reflow.delta) if reflow and sch.elastic else None
    schedule = tuple((int(a), int(b)) for a, _, b in (x.partition(":") for x in sch.placement_schedule)) \
        if reflow else ()
    refills = fresh_filter(cfg) != "accept_all"             # a fresh filter may leave batches short
    return Settings(rules=rules(cfg.reflow.mode, refills=refills), steps=cfg.trainer.steps,
                    sync_every=cfg.reflow.sync_every,
                    cap_max=cap_max if cap_max is not None else cfg.rollout.max_concurrency,
                    kv_budget=kv_budget if kv_budget is not None else cfg.rollout.kv_budget_tokens,
                    scheduling=scheduling, placement=placement, placement_schedule=schedule,
                    checkpoint_every=cfg.checkpoint.every_steps, timeout_s=cfg.run.timeout_s,
                    setup_timeout_s=cfg.run.setup_timeout_s, eval_every=cfg.run.eval_every_steps,
                    time_budget_s=cfg.trainer.time_budget_s,
                    event_log=event_log if event_log is not None else cfg.run.event_log, replica_size=replica_size,
                    rollout_tp=rollout_tp if rollout_tp is not None else res.rollout_tp_size)


def new_coordinator(cfg: Config, settings: Settings, *, trainers: list[int], rollouts: list[int], world: int,
                    resume_from: str | None = None, prompt_key: Callable[[int], int] | None = None) -> Coordinator:
    """A coordinator with the config's replay index (:func:`replay_index`)."""
    return Coordinator(settings, replay_index(cfg, prompt_key), trainers=trainers, rollouts=rollouts, world=world,
                       resume_from=resume_from)


def replay_index(cfg: Config, prompt_key: Callable[[int], int] | None = None) -> ReplayIndex:
    """The config's replay index: σ, τ, δ, b_max, sampler, replay filter, seed, the objective's advantage
    estimator, the fresh-sample hooks (dynamic sampling and its cap), and the replayed advantages, whose
    prompts ``prompt_key`` identifies (None: by dispatch index; the runtime passes the task's, see
    ``runtime/training.py`` ``prompt_key``)."""
    a = cfg.algorithm
    estimator, agg = objective_traits(cfg)
    # seq_mean_token_mean gives every sample the same share of the loss, so its weights average 1 per sample
    return build_index(cfg.reflow, group_size=a.group_size, batch_size=cfg.trainer.batch_size, seed=cfg.run.seed,
                       adv_eps=a.adv_eps, adv_std_norm=a.adv_std_norm, adv_estimator=estimator,
                       per_sample_weights=agg == "seq_mean_token_mean", dynamic_sampling=dynamic_sampling(cfg),
                       max_gen_batches=a.max_gen_batches, replay_advantage=a.replay_advantage,
                       prompt_key=prompt_key)
