"""PPO with a critic (Schulman et al. 2017, Proximal Policy Optimization Algorithms; advantages by GAE,
Schulman et al. 2016, High-Dimensional Continuous Control Using Generalized Advantage Estimation; KL in the
reward as in Ouyang et al. 2022, InstructGPT).

The coordinator's estimator is ``none`` (every A_i = 0, :mod:`reflow_hpc.core.advantages`): the trainer
computes a per-token advantage itself, at the step that trains the sample, from its critic
(:mod:`reflow_hpc.train.critic`, ``[critic]``), a value model with the policy's architecture started from
the policy's weights with a fresh value head. Over the loss tokens k = 1..n of sample i (the tokens the
policy generated; prompt, tool-observation and padding positions are skipped — the reward and the
bootstrap pass over them to the previous loss token, and they carry no loss):

    r_k   = -β · KL_k  (+ R_i at k = n)      R_i the sample's reward; KL_k = KL(π_behav ‖ π_ref) of token k by
                                             algorithm.kl_estimator, β = kl_coef, only with kl_in_reward
    δ_k   = r_k + γ V_old(k+1) − V_old(k)      V_old(n+1) = 0; γ = gae_gamma, λ = gae_lambda
    A_k   = δ_k + γλ A_{k+1}                 returns  Ret_k = A_k + V_old(k)
    Â_k   = (A_k − mean A) / (std A + adv_eps)   over every loss token of the batch (critic.whiten_advantages;
                                             the moments are summed over micro-batches and trainer ranks)
    ℓ_t   = −min(ρ_t Â_t, clip(ρ_t, 1 − clip_low, 1 + clip_high) Â_t)     (dual clip: clip_ratio_c)
    L_V   = Σ_k ½ · max((V_k − Ret_k)², (clip(V_k, V_old(k) ± ε) − Ret_k)²) / N     ε = critic.value_clip

aggregated by ``token_mean`` (N = the batch's loss tokens) unless ``algorithm.loss_agg`` says otherwise;
the critic's loss is always a token mean, without the replay weights (a replayed sample's return is as
good a regression target as a fresh one's). V_old is the critic's value at the start of the step, taken
in the same forward that carries the critic's gradient, so V = V_old in L_V (one update per batch) and
the value clip does not bind. With ``kl_in_reward`` the loss adds no KL term.

Replay and partial rollouts: advantages are never stored. A replayed sample's values are recomputed by the
current critic and its GAE advantage recomputed at the step that trains it; tokens of different policy
versions in one sample (partial rollouts) are one episode, the ratio of each against the log-prob that
version recorded. Critic warm-up (``critic.warmup_steps``): during the critic's first updates the policy is
not run at all (its loss metrics read 0), its weights, optimizer and schedule stand still.
"""

from __future__ import annotations

from .grpo import GRPO


class PPO(GRPO):
    advantage = "none"
    loss_agg = "token_mean"
    uses_critic = True
