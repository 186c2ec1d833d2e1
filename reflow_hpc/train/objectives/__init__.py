"""Objectives by name (``algorithm.name``): one module each, with its formula and source.

The built-in objectives are filled into :data:`BUILTIN` here, the one place, and nowhere else;
importing a module of this package registers nothing. Their advantage estimator and default
aggregation are also named in ``config.BUILTIN_OBJECTIVES`` (validation and the coordinator must
not import torch); a test holds the two tables equal. A plugin (``run.plugins``) adds one with
``@reflow_hpc.plugins.register_objective("name")`` on a subclass of
:class:`~reflow_hpc.train.objectives.base.Objective`.

| name | advantage | per-token loss | default aggregation |
| --- | --- | --- | --- |
| grpo | (r - mean) / std | PPO clip of ρ_t | token_mean |
| dr_grpo | r - mean | PPO clip of ρ_t | seq_mean_token_sum_norm |
| dapo | (r - mean) / std | PPO clip of ρ_t, clip-higher | token_mean |
| gspo | (r - mean) / std | PPO clip of the sequence ratio s_i | seq_mean_token_mean |
| cispo | (r - mean) / std | -sg(min(ρ_t, ε_max)) A log π | token_mean |
| rloo | r - mean of the others | PPO clip of ρ_t | token_mean |
| ppo | none (per-token GAE from the trainer's critic) | PPO clip of ρ_t, A per token | token_mean |
"""

from __future__ import annotations

from typing import Any

from ... import plugins
from .base import Objective
from .cispo import CISPO
from .dapo import DAPO
from .dr_grpo import DrGRPO
from .grpo import GRPO
from .gspo import GSPO
from .ppo import PPO
from .rloo import RLOO

BUILTIN: dict[str, type[Objective]] = {
    "grpo": GRPO, "dr_grpo": DrGRPO, "dapo": DAPO, "gspo": GSPO, "cispo": CISPO, "rloo": RLOO, "ppo": PPO,
}
for _name, _cls in BUILTIN.items():
    _cls.name = _name


def objective_class(name: str) -> type[Objective]:
    """The class of ``algorithm.name = name``: built in, or registered by a plugin."""
    cls = BUILTIN.get(name) or plugins.objective_class(name)
    if cls is None:
        raise ValueError(f'algorithm.name = "{name}": unknown objective; known: '
                         + ", ".join([*BUILTIN, *plugins.objective_names()]))
    return cls


def make_objective(alg: Any) -> Objective:
    """The objective the ``[algorithm]`` section selects, configured from it."""
    return objective_class(alg.name).from_config(alg)
