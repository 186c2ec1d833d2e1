"""The interface of an objective (``algorithm.name``) and the PPO clip several of them share.

An objective is a small class: the name of its advantage estimator (``advantage``, one of
:data:`reflow_hpc.core.advantages.ESTIMATORS`; the coordinator computes advantages when a group
completes), its default aggregation (``loss_agg``, used when ``algorithm.loss_agg`` is empty) and
:meth:`Objective.per_token_loss`, the policy-gradient term of every token. Everything around that
term is the same for every objective and lives in :mod:`reflow_hpc.train.loss`: the replay weights
w̃_i, the off-policy correction (``algorithm.is_cap``), KL, the entropy bonus and the aggregation.
An objective with ``uses_critic`` (ppo) gets a critic on the trainer (:mod:`reflow_hpc.train.critic`) and a
per-token advantage ``[B, S]`` computed there instead of the coordinator's ``[B, 1]``.

Add one in a ``run.plugins`` module::

    from reflow_hpc.plugins import register_objective
    from reflow_hpc.train.objectives.base import Objective, PgTerms

    @register_objective("reinforce")
    class Reinforce(Objective):
        advantage, loss_agg = "group_centre", "token_mean"

        def per_token_loss(self, logp, old_logp, mask, adv):
            ratio = torch.exp(torch.where(mask, logp - old_logp, torch.zeros_like(logp)))
            return PgTerms(-adv * ratio, ratio, torch.zeros_like(mask))
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar, NamedTuple

import torch


class PgTerms(NamedTuple):
    loss: torch.Tensor       # [B, S] (or [B, 1], broadcast over the tokens): the policy-gradient term
    ratio: torch.Tensor      # [B, S] or [B, 1]: the importance ratio the term uses (metrics only)
    clipped: torch.Tensor    # bool, [B, S] or [B, 1]: where a clip binds, so the token gets no gradient


class Objective(abc.ABC):
    """Base class; see the module docstring. ``from_config`` receives the ``[algorithm]`` section."""

    name: ClassVar[str] = ""
    advantage: ClassVar[str] = "group_norm"
    loss_agg: ClassVar[str] = "token_mean"
    uses_critic: ClassVar[bool] = False

    def __init__(self, alg: Any):
        self.alg = alg

    @classmethod
    def from_config(cls, alg: Any) -> "Objective":
        return cls(alg)

    @abc.abstractmethod
    def per_token_loss(self, logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor,
                       adv: torch.Tensor) -> PgTerms:
        """The term of each token. ``logp`` [B, S] carries the gradient; ``old_logp`` [B, S] is the
        (detached) policy the ratio is taken against — the behaviour policy, or the proximal one under
        the off-policy correction; ``mask`` [B, S] bool marks loss tokens; ``adv`` is [B, 1], or [B, S] per
        token for an objective that ``uses_critic``."""


def ppo_clip(ratio: torch.Tensor, adv: torch.Tensor, clip_low: float, clip_high: float,
             clip_c: float = 0.0) -> PgTerms:
    """PPO's clipped surrogate ``-min(r A, clip(r, 1 - ε_low, 1 + ε_high) A)`` (Schulman et al. 2017),
    with the dual clip ``min(·, -c A)`` for A < 0 when ``clip_c > 0`` (Ye et al. 2020): a token with a
    huge ratio and a negative advantage cannot push the loss without bound."""
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    pg = torch.maximum(unclipped, clipped)
    binding = clipped > unclipped
    if clip_c > 0:
        cap = -adv * clip_c
        neg = (adv < 0).expand_as(pg)
        binding = binding | (neg & (pg > cap))
        pg = torch.where(neg, torch.minimum(pg, cap), pg)
    return PgTerms(pg, ratio, binding)


def token_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``exp(logp - old_logp)`` on loss tokens, 1 elsewhere: padding must not overflow into NaN gradients."""
    return torch.exp(torch.where(mask, logp - old_logp, torch.zeros_like(logp)))
