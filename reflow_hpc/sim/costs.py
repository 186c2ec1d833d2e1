"""Cost model of the simulated cluster: how long generation, training, weight sync, role switches and
tool calls take. Pure functions of the ``[sim]`` config keys (:class:`reflow_hpc.config.SimConfig`);
numbers and sources in ``shared/notes/cost-model.md`` and in the comments of ``configs/sim_*.toml``.

Symbols
-------
``N``      parameters of the policy (``sim.model_params``)
``n_l, d`` layers and hidden size (``sim.model_layers``, ``sim.model_hidden``)
``κ``      KV-cache bytes per token (``sim.kv_bytes_per_token``)
``M``      bytes of the weights (``sim.weight_bytes``, 0 = 2N: bf16)
``F``      peak bf16 FLOP/s of one GPU (``sim.gpu_flops``); ``BW`` its HBM bandwidth (``sim.gpu_hbm_bw``)
``t``      GPUs of one rollout engine (tensor parallel, ``resources.rollout_tp_size``)
``m``      engines of one simulated worker (``u/t``, :mod:`reflow_hpc.sim.workload`)
``g``      GPUs of one trainer replica (its FSDP group; ``u`` for a simulated worker)
``n``      running sequences of a worker; ``S`` the sum of their contexts (prompt + generated tokens)

Decode (one engine step: every running sequence gets one token)
    ``t_dec(n, S) = a + max((M/t + κ·S/t) / BW_t,  2N·n / (t·F_dec))``
    with ``a = sim.decode_base_s``, ``BW_t = BW · sim.decode_bw_efficiency · e_t`` (``e_t`` from
    ``sim.decode_tp_efficiency`` for t = 1, 2, 4, 8) and ``F_dec = F · sim.decode_compute_efficiency``.
    The memory term reads the weights once per step plus every running sequence's KV cache; the
    compute term binds only for large batches on compute-poor GPUs (H20). A worker's m engines share
    its requests evenly, so each runs n/m of them with contexts S/m and all advance together: the
    formula holds with ``n → n/m`` and ``S → S/m``. Between two events n is
    fixed and S grows by n per step, so the time of k steps is a sum of ``max(A + B·i, C)`` over
    ``i < k`` — closed form in :func:`decode_time` and its inverse :func:`decode_steps`.
KV capacity of an engine (tokens; a worker holds m of them)
    ``K = (φ · HBM · t − M − r · t) / κ`` with ``φ = sim.kv_memory_fraction``, ``HBM = sim.gpu_memory_bytes``,
    ``r = sim.kv_reserve_bytes`` (activations, CUDA graphs) per GPU.
Prefill (a batch of requests admitted together; request j brings ``T_j`` new tokens after ``c_j`` cached ones)
    ``t_pre = a_p + Σ_j [2N·T_j + 4·n_l·d·T_j·(c_j + T_j/2)] / (m·t·F_pre)``, ``F_pre = F · sim.prefill_efficiency``,
    ``a_p = sim.prefill_base_s``. A group's prompt is charged once (prefix cache); a request resumed after
    a weight sync or a preemption re-prefills its whole context at the same formula.
Training step (one replica, its share of the batch: samples of total length L_i = prompt + response)
    ``t_train = Σ_i L_i·(6N + 6·n_l·d·L_i) / (g·η·F) + m · t_opt``
    with ``η = sim.train_mfu``, ``m = sim.train_minibatches`` optimizer updates per step and
    ``t_opt = sim.train_update_overhead_s`` (exposed FSDP collectives, optimizer, launch: per update,
    independent of g). A mode in ``sim.logprob_recompute_modes`` adds one forward pass,
    ``Σ_i L_i·(2N + 2·n_l·d·L_i) / (g·η·F)``, for the old log-probs.
Weight sync
    split pools: ``t_sync = t₀ + M / B`` with B = ``sim.sync_bw_intra`` when the trainer and every rollout
    GPU share one node (``slurm.gpus_per_node``), else ``sim.sync_bw_inter`` (a pipelined broadcast is
    nearly independent of the receivers, Laminar App. D); colocated: ``t_sync = t₀c + M / B_c``.
Role switch (elastic pool, DESIGN §8; ``t_fix = sim.switch_fixed_s``)
    trainer → rollout: ``t_fix + M/(t·B_h2d)`` (each GPU wakes its engine's weights from host memory;
    the sync that follows brings the current ones); rollout → trainer: ``t_fix + M/(t·B_h2d) + 16·N/(g·B_shard)``
    (park the engine; receive the parameter, gradient and Adam shard — 16 bytes per parameter over the
    replica's g GPUs — from the same shard of an existing replica, which is busy ``16·N/(g·B_shard)``).
Tool call (multi-turn tasks)
    latency ``~ LogNormal(ln m_tool, σ_tool)`` capped at ``sim.tool_latency_max_s``; the observation's
    ``sim.tool_observation_tokens`` are prefilled when the sample resumes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Bytes a trainer holds per parameter: bf16 weight (2) and gradient (2), fp32 Adam moments (8) and
# fp32 master weight (4) — what a rollout → trainer switch must receive, sharded over the replica.
TRAINER_BYTES_PER_PARAM = 16
# Tensor-parallel sizes that sim.decode_tp_efficiency lists, in order.
TP_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True)
class Costs:
    """The cost model of one simulated cluster (module docstring); build with :meth:`from_config`."""
    params: float
    layers: int
    hidden: int
    kv_bytes: float
    weight_bytes: float
    flops: float
    hbm_bw: float
    memory: float
    gpus_per_node: int
    decode_base_s: float
    decode_bw: float                 # BW · decode_bw_efficiency (TP1)
    decode_tp_efficiency: tuple
    decode_flops: float
    prefill_base_s: float
    prefill_flops: float
    kv_memory_fraction: float
    kv_reserve_bytes: float
    train_mfu: float
    train_minibatches: int
    train_update_overhead_s: float
    logprob_recompute_modes: tuple
    sync_base_s: float
    sync_bw_intra: float
    sync_bw_inter: float
    sync_colocated_base_s: float
    sync_colocated_bw: float
    switch_fixed_s: float
    switch_h2d_bw: float
    switch_shard_bw: float
    tool_latency_median_s: float
    tool_latency_sigma: float
    tool_latency_max_s: float
    tool_observation_tokens: int

    @classmethod
    def from_config(cls, cfg) -> "Costs":
        s = cfg.sim
        return cls(
            params=s.model_params, layers=s.model_layers, hidden=s.model_hidden, kv_bytes=s.kv_bytes_per_token,
            weight_bytes=s.weight_bytes or 2.0 * s.model_params, flops=s.gpu_flops, hbm_bw=s.gpu_hbm_bw,
            memory=s.gpu_memory_bytes, gpus_per_node=max(1, cfg.slurm.gpus_per_node),
            decode_base_s=s.decode_base_s, decode_bw=s.gpu_hbm_bw * s.decode_bw_efficiency,
            decode_tp_efficiency=tuple(s.decode_tp_efficiency), decode_flops=s.gpu_flops * s.decode_compute_efficiency,
            prefill_base_s=s.prefill_base_s, prefill_flops=s.gpu_flops * s.prefill_efficiency,
            kv_memory_fraction=s.kv_memory_fraction, kv_reserve_bytes=s.kv_reserve_bytes,
            train_mfu=s.train_mfu, train_minibatches=s.train_minibatches,
            train_update_overhead_s=s.train_update_overhead_s,
            logprob_recompute_modes=tuple(s.logprob_recompute_modes),
            sync_base_s=s.sync_base_s, sync_bw_intra=s.sync_bw_intra, sync_bw_inter=s.sync_bw_inter,
            sync_colocated_base_s=s.sync_colocated_base_s, sync_colocated_bw=s.sync_colocated_bw,
            switch_fixed_s=s.switch_fixed_s, switch_h2d_bw=s.switch_h2d_bw, switch_shard_bw=s.switch_shard_bw,
            tool_latency_median_s=s.tool_latency_median_s, tool_latency_sigma=s.tool_latency_sigma,
            tool_latency_max_s=s.tool_latency_max_s, tool_observation_tokens=s.tool_observation_tokens)

    # ------------------------------------------------------------------------------------------
    # Rollout instances
    # ------------------------------------------------------------------------------------------

    def tp_efficiency(self, tp: int) -> float:
        if tp not in TP_SIZES:
            raise ValueError(f"resources.rollout_tp_size = {tp}: the cost model knows TP sizes {TP_SIZES}")
        return self.decode_tp_efficiency[TP_SIZES.index(tp)]

    def kv_capacity(self, tp: int) -> float:
        """K: KV-cache tokens one instance of ``tp`` GPUs holds (0 or less: the weights do not fit)."""
        return (self.kv_memory_fraction * self.memory * tp - self.weight_bytes - self.kv_reserve_bytes * tp) / self.kv_bytes

    def decode_terms(self, tp: int, n: int, s: float, engines: int = 1) -> tuple[float, float, float]:
        """(A, B, C) of one step's time ``max(A + B·i, C)`` i steps after a state of n running sequences
        whose contexts sum to ``s``, spread over ``engines`` engines of ``tp`` GPUs: A, B the memory-bound
        part and its growth per step, C the compute bound."""
        a0, a1, c0, c1 = self.decode_coefficients(tp, engines)
        return a0 + a1 * s, a1 * n, c0 + c1 * n

    def decode_coefficients(self, tp: int, engines: int = 1) -> tuple[float, float, float, float]:
        """(a0, a1, c0, c1) with A = a0 + a1·S, B = a1·n and C = c0 + c1·n in :meth:`decode_terms`
        (constant for a worker: the simulator folds them once)."""
        bw = self.decode_bw * self.tp_efficiency(tp) * tp
        return (self.decode_base_s + self.weight_bytes / bw, self.kv_bytes / (engines * bw),
                self.decode_base_s, 2.0 * self.params / (engines * tp * self.decode_flops))

    def decode_step_time(self, tp: int, n: int, s: float, engines: int = 1) -> float:
        """t_dec(n, S): one decode step."""
        a, _, c = self.decode_terms(tp, n, s, engines)
        return max(a, c)

    # ------------------------------------------------------------------------------------------
    # Prefill
    # ------------------------------------------------------------------------------------------

    def prefill_flops_of(self, new_tokens: float, cached: float = 0.0) -> float:
        """FLOPs of prefilling ``new_tokens`` after ``cached`` tokens already in the KV cache."""
        return 2.0 * self.params * new_tokens + 4.0 * self.layers * self.hidden * new_tokens * (cached + new_tokens / 2.0)

    def prefill_time(self, gpus: int, flops: float) -> float:
        """t_pre of one admission batch whose requests need ``flops`` in all, on ``gpus`` GPUs (m·t)."""
        return self.prefill_base_s + flops / (gpus * self.prefill_flops) if flops > 0 else 0.0

    # ------------------------------------------------------------------------------------------
    # Training
    # ------------------------------------------------------------------------------------------

    def train_time(self, gpus: int, lengths, mode: str) -> float:
        """t_train of one replica of ``gpus`` GPUs on samples of total lengths ``lengths``."""
        compute, update = self.train_parts(gpus, lengths, mode)
        return compute + update

    def train_parts(self, gpus: int, lengths, mode: str) -> tuple[float, float]:
        """t_train split as the trainer reports it: (forward and backward passes, the optimizer updates)."""
        lin = quad = 0.0
        for n in lengths:
            lin += n
            quad += n * n
        per_pass = self.params * lin + self.layers * self.hidden * quad     # Σ L·(N + n_l·d·L)
        passes = 6.0 + (2.0 if mode in self.logprob_recompute_modes else 0.0)
        return (passes * per_pass / (gpus * self.train_mfu * self.flops),
                self.train_minibatches * self.train_update_overhead_s)

    # ------------------------------------------------------------------------------------------
    # Weight sync and role switches
    # ------------------------------------------------------------------------------------------

    def sync_time(self, gpus_in_group: int) -> float:
        """Broadcast from the trainer to the rollout workers, ``gpus_in_group`` GPUs taking part."""
        bw = self.sync_bw_intra if gpus_in_group <= self.gpus_per_node else self.sync_bw_inter
        return self.sync_base_s + self.weight_bytes / bw

    def colocated_sync_time(self) -> float:
        """A colocated worker loads its own trainer's new weights into its engine."""
        return self.sync_colocated_base_s + self.weight_bytes / self.sync_colocated_bw

    def shard_transfer_time(self, trainer_gpus: int) -> float:
        """A new trainer replica of ``trainer_gpus`` GPUs receives its state from an existing one."""
        return TRAINER_BYTES_PER_PARAM * self.params / max(1, trainer_gpus) / self.switch_shard_bw

    def role_switch_time(self, direction: str, *, trainer_gpus: int, tp: int) -> float:
        """A worker changes role (``"to_rollout"`` or ``"to_trainer"``); ``trainer_gpus`` = g of the replica
        it joins or leaves, ``tp`` the GPUs of each of its engines."""
        wake = self.weight_bytes / (tp * self.switch_h2d_bw)
        if direction == "to_rollout":
            return self.switch_fixed_s + wake
        if direction == "to_trainer":
            return self.switch_fixed_s + wake + self.shard_transfer_time(trainer_gpus)
        raise ValueError(f"role switch direction {direction!r}: expected to_rollout or to_trainer")

    # ------------------------------------------------------------------------------------------
    # Tools
    # ------------------------------------------------------------------------------------------

    def tool_latency(self, rng) -> float:
        """One tool call's latency, drawn from ``rng`` (a ``random.Random``)."""
        x = self.tool_latency_median_s * math.exp(self.tool_latency_sigma * rng.gauss(0.0, 1.0))
        return min(x, self.tool_latency_max_s)


# ----------------------------------------------------------------------------------------------
# Closed forms of decode time over k steps (module docstring, "Decode")
# ----------------------------------------------------------------------------------------------

def decode_time(a: float, b: float, c: float, k: float) -> float:
    """Σ_{i<k} max(a + b·i, c): the time of k decode steps (k may be fractional; a fraction of a step
    takes that fraction of the step's time)."""
    if k <= 0.0:
        return 0.0
    i0 = _compute_bound_steps(a, b, c, k)
    t = i0 * c
    rest = k - i0
    if rest > 0.0:
        start = a + b * i0
        t += rest * start + b * rest * (rest - 1.0) / 2.0 if rest >= 1.0 else rest * start
    return t


def decode_steps(a: float, b: float, c: float, dt: float) -> float:
    """The inverse of :func:`decode_time`: how many steps fit in ``dt`` seconds."""
    if dt <= 0.0:
        return 0.0
    i0 = _compute_bound_steps(a, b, c, float("inf"))
    if dt <= i0 * c:
        return dt / c
    dt -= i0 * c
    start = a + b * i0
    if start <= 0.0:
        raise ValueError("decode step time must be positive")
    if dt <= start or b <= 0.0:                  # less than one step, or constant steps: linear
        return i0 + dt / start
    # rest·start + b·rest(rest-1)/2 = dt  →  (b/2)·rest² + q·rest − dt = 0, q = start − b/2; the root in the
    # form that does not cancel when b is small.
    q = start - b / 2.0
    return i0 + 2.0 * dt / (q + (q * q + 2.0 * b * dt) ** 0.5)


def _compute_bound_steps(a: float, b: float, c: float, k: float) -> float:
    """How many of the first k steps take c (the compute bound) rather than a + b·i."""
    if a >= c:
        return 0.0
    crossing = (c - a) / b if b > 0.0 else math.inf
    # The step that crosses is compute-bound; never more than k steps (k may be a fraction of the crossing).
    return k if crossing >= k else min(k, float(math.ceil(crossing)))
