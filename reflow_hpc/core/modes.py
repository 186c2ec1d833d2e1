"""The four modes (DESIGN §9) as rules: one table that the config check, the coordinator, the simulator,
the benchmarks and the tests all read.

Staleness is counted in **optimizer steps**. The policy version of a set of weights is the number of
optimizer updates in them: the trainer's version rises by one at every step, and a sync publishes the
trainer's current version to the rollout workers. Every generated token carries the version of the
weights that generated it, and the staleness of a sample when it is trained is the trainer's version
minus its oldest token version. So with ``sync_every = k`` a sync advances the published version by k.

| mode | pools | dispatch | replay (σ) | guarantee on every trained token |
| --- | --- | --- | --- | --- |
| ``sync`` | colocated | one batch per step | no | version = the trainer's (on-policy) |
| ``one_step_off`` | split | one batch per step, no partial rollouts | no | exactly one step behind (the first batch: on-policy) |
| ``fully_async`` | split | streaming, partial rollouts | no | at most δ steps behind |
| ``reflow`` | split | streaming, partial rollouts | ≤ σ of a batch | at most δ steps behind |

``fully_async`` follows verl's fully-async trainer: a streaming rollouter on its own devices,
``sync_every`` plays its ``trigger_parameter_sync_step``, the dispatch window ``b_max`` its
``staleness_threshold`` (samples generated ahead of the trainer), and δ drops what is older than
the bound instead of training it.

A fresh filter that drops groups (dynamic sampling, :mod:`reflow_hpc.core.fresh`) leaves a batch-level
mode's batch short; the trainer then waits for refill groups generated on the newest weights, which
are on-policy when trained. So with ``refills`` the guarantee of ``one_step_off`` is "at most one
step behind" (``sync`` keeps its own), and the index holds unused samples no staler than the mode's
exact staleness: the surplus of a refill that a batch leaves is evicted at the next version bump.

A configuration under which a mode cannot keep its guarantee is refused by :func:`check` (the config
loader turns it into a one-line ``config error``); nothing is overridden silently.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ModeRules:
    mode: str
    colocated: bool          # every worker generates a batch, then every worker trains on it
    replays: bool            # σ may be above 0
    batch_level: bool        # one batch is dispatched per step (b_max = batch size)
    partial_rollouts: bool   # a sync may hold in-flight requests and resume them under new weights
    exact_staleness: int | None   # every trained token is exactly this many steps behind (None: ≤ δ)
    refills: bool = False    # a fresh filter drops groups: batch-level refills may be on-policy (docstring)

    def staleness_ok(self, staleness: int, delta: int, step: int) -> bool:
        """Whether a token trained at 0-based ``step`` with this staleness keeps the mode's guarantee.
        The allowed staleness values form an interval (checkers rely on it: a batch keeps the guarantee
        when its least and greatest staleness do)."""
        if self.exact_staleness is None:
            return 0 <= staleness <= delta
        if self.refills:
            return 0 <= staleness <= min(self.exact_staleness, step)
        return staleness == min(self.exact_staleness, step)

    def pool_delta(self, delta: int) -> int:
        """The staleness bound of the index: δ, or the exact staleness of a batch-level mode with refills."""
        if self.refills and self.exact_staleness is not None:
            return min(delta, self.exact_staleness)
        return delta


MODES: dict[str, ModeRules] = {
    "sync": ModeRules("sync", colocated=True, replays=False, batch_level=True, partial_rollouts=False,
                      exact_staleness=0),
    "one_step_off": ModeRules("one_step_off", colocated=False, replays=False, batch_level=True,
                              partial_rollouts=False, exact_staleness=1),
    "fully_async": ModeRules("fully_async", colocated=False, replays=False, batch_level=False,
                             partial_rollouts=True, exact_staleness=None),
    "reflow": ModeRules("reflow", colocated=False, replays=True, batch_level=False, partial_rollouts=True,
                        exact_staleness=None),
}


class ModeError(ValueError):
    """A setting the chosen mode cannot honour: names the key, the value and why."""

    def __init__(self, key: str, value: object, why: str):
        self.key, self.value, self.why = key, value, why
        super().__init__(f"{key} = {value!r}: {why}")


def rules(mode: str, *, refills: bool = False) -> ModeRules:
    """The rules of ``mode``; ``refills``: a fresh filter that may drop groups is in force."""
    try:
        r = MODES[mode]
    except KeyError:
        raise ModeError("reflow.mode", mode, "allowed: " + ", ".join(MODES)) from None
    return replace(r, refills=True) if refills else r


def check(mode: str, *, sigma: float, delta: int, b_max: int, batch_size: int, sync_every: int,
          refills: bool = False) -> ModeRules:
    """The rules of ``mode``, or :class:`ModeError` for the first setting that would break its guarantee.
    ``b_max`` is the effective dispatch window (the config's 0 already replaced by the batch size)."""
    r = rules(mode, refills=refills)
    if not r.replays and sigma > 0:
        raise ModeError("reflow.sigma", sigma, f"mode {mode} trains every sample once (no replay); set "
                                               f"reflow.sigma = 0, or use mode reflow")
    if r.exact_staleness is not None and sync_every != 1:
        raise ModeError("reflow.sync_every", sync_every,
                        f"mode {mode} trains every token exactly {r.exact_staleness} step(s) behind the trainer, "
                        f"which needs a sync after every step; set reflow.sync_every = 1")
    if r.batch_level and b_max != batch_size:
        raise ModeError("reflow.b_max", b_max, f"mode {mode} dispatches exactly one batch per step; set "
                                               f"reflow.b_max = 0 (the batch size, {batch_size})")
    if r.exact_staleness is not None and delta < r.exact_staleness:
        raise ModeError("reflow.delta", delta, f"mode {mode} trains samples {r.exact_staleness} step(s) old; "
                                               f"δ must be at least {r.exact_staleness}")
    if r.exact_staleness is None and delta < sync_every:
        # The rollout weights lag the trainer by up to sync_every − 1 steps, and a sample generated in one
        # sync period is trained in the next at the earliest: it is sync_every steps old by then.
        raise ModeError("reflow.delta", delta,
                        f"with reflow.sync_every = {sync_every} a sample generated just after a sync is "
                        f"{sync_every} step(s) old when the next period trains it, so the pipeline would drop "
                        f"what it generates ahead; set reflow.delta ≥ {sync_every} or sync more often")
    return r
