"""Objectives (algorithm.name), aggregations (algorithm.loss_agg) and what the loss adds around them.

Each objective is checked in float64 against a plain re-implementation of its published formula
written here with loops (:func:`reference_loss`), on random tensors with tokens of mixed policy
versions, tool-observation holes, padding with extreme values and replay weights: loss and gradient
to 1e-10. Then: micro-batch and replica splits sum to the one-batch gradient, a hand-worked example
per objective, TRL's own GRPOTrainer._compute_loss on the same inputs, and the pieces (dual clip,
KL estimators, TIS/MIS, Z per aggregation, advantage estimators, config rules, registry).
"""

from __future__ import annotations

import math
import types
import zlib
from collections import defaultdict

import pytest
import torch

import reflow_hpc.config as C
from reflow_hpc import plugins
from reflow_hpc.core.advantages import group_advantages
from reflow_hpc.core.mixing import loss_weights
from reflow_hpc.train.loss import LossSettings, kl_estimate, loss_metrics, policy_loss, rollout_is_weights
from reflow_hpc.train.objectives import BUILTIN, make_objective
from reflow_hpc.train.objectives.base import Objective, PgTerms

OBJECTIVES = ("grpo", "dr_grpo", "dapo", "gspo", "cispo", "rloo")
AGGS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm")
L_MAX = 16


def algorithm(name: str, **kw) -> C.AlgorithmConfig:
    a = C.AlgorithmConfig()
    a.name, a.clip_low, a.clip_high = name, 0.2, 0.25
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def settings(name: str, agg: str, **kw) -> LossSettings:
    a = algorithm(name, **kw)
    return LossSettings(objective=make_objective(a), loss_agg=agg, max_response_len=L_MAX, kl_coef=a.kl_coef,
                        kl_estimator=a.kl_estimator, entropy_coef=a.entropy_coef, is_cap=a.is_cap,
                        is_level=a.is_level, is_mode=a.is_mode, is_low=a.is_low)


# ------------------------------------------------------------------------------------------------
# Random batches
# ------------------------------------------------------------------------------------------------

def random_batch(seed: int, rows: int = 7, width: int = 12, agg: str = "token_mean"):
    """Rows of different lengths: a prompt (no loss), response tokens from policy versions 3..5 (the
    older the version, the further the behaviour log-prob from the current one), a tool observation
    hole in some rows, right padding holding extreme values; replay weights normalised for ``agg``."""
    g = torch.Generator().manual_seed(seed)
    logp = torch.randn(rows, width, generator=g, dtype=torch.float64) * 0.7 - 1.5
    behaviour = torch.empty_like(logp)
    ref = logp + 0.3 * torch.randn(rows, width, generator=g, dtype=torch.float64)
    entropy = torch.rand(rows, width, generator=g, dtype=torch.float64) * 2
    mask = torch.zeros(rows, width, dtype=torch.bool)
    for i in range(rows):
        prompt = int(torch.randint(1, 3, (1,), generator=g))
        length = int(torch.randint(prompt + 2, width + 1, (1,), generator=g))
        mask[i, prompt:length] = True
        if length - prompt > 5 and i % 2:
            mask[i, prompt + 2:prompt + 4] = False                  # a tool observation: no loss
        for t in range(width):
            version = 3 + (t * 7 + i) % 3                             # mixed versions inside a sample
            behaviour[i, t] = logp[i, t] + (5 - version) * 0.25 * float(torch.randn(1, generator=g))
        logp[i, length:] = 40.0                                       # padding: must not leak
        behaviour[i, length:] = -40.0
    rewards = torch.randint(0, 2, (rows,), generator=g).double().tolist()
    adv = torch.tensor(group_advantages(rewards, eps=1e-6), dtype=torch.float64)
    is_replay = [i % 3 == 2 for i in range(rows)]
    n = mask.sum(-1).tolist()
    w = torch.tensor(loss_weights(is_replay, n, 0.5, per_sample=agg == "seq_mean_token_mean"), dtype=torch.float64)
    return logp, behaviour, mask, adv, w, ref, entropy


# ------------------------------------------------------------------------------------------------
# The published formulas, written plainly
# ------------------------------------------------------------------------------------------------

def reference_loss(name, logp, behaviour, mask, adv, w, *, agg, n_tokens, n_samples, max_len=L_MAX,
                   clip_low=0.2, clip_high=0.25, dapo_high=0.28, gspo_low=3e-4, gspo_high=4e-4, cispo_cap=5.0,
                   cispo_low=0.2,
                   clip_c=0.0, is_cap=0.0, is_level="token", is_mode="truncate", is_low=0.0, kl_coef=0.0, ref=None,
                   kl_kind="k3", ent_coef=0.0, entropy=None):
    total = torch.zeros((), dtype=torch.float64)
    rows, width = logp.shape
    for i in range(rows):
        toks = [t for t in range(width) if mask[i, t]]
        if not toks:
            continue
        a = float(adv[i])
        # The policy the ratio is taken against: behaviour, or (decoupled) the proximal = current, detached.
        old = {t: (logp[i, t].detach() if is_cap > 0 else behaviour[i, t]) for t in toks}
        weight = {t: 1.0 for t in toks}
        if is_cap > 0:
            if is_level == "token":
                raw = {t: math.exp(float(logp[i, t].detach()) - float(behaviour[i, t])) for t in toks}
            else:
                prod = 1.0
                for t in toks:
                    prod *= math.exp(float(logp[i, t].detach()) - float(behaviour[i, t]))
                raw = {t: prod for t in toks}
            for t in toks:
                if is_mode == "truncate":
                    weight[t] = min(raw[t], is_cap)
                else:
                    weight[t] = 0.0 if raw[t] > is_cap or raw[t] < is_low else raw[t]
        terms = {}
        if name == "gspo":
            mean_log = sum(logp[i, t] - old[t] for t in toks) / len(toks)
            s = torch.exp(mean_log)
            seq = -torch.minimum(s * a, torch.clamp(s, 1 - gspo_low, 1 + gspo_high) * a)
            for t in toks:
                terms[t] = seq
        for t in toks:
            r = torch.exp(logp[i, t] - old[t])
            if name == "cispo":   # MiniMax-M1's token mask: a falling negative-advantage token stops
                live = not (a < 0 and float(r.detach()) < 1 - cispo_low)
                terms[t] = -min(float(r.detach()), cispo_cap) * a * logp[i, t] * float(live)
            elif name != "gspo":
                hi = dapo_high if name == "dapo" else clip_high
                term = -torch.minimum(r * a, torch.clamp(r, 1 - clip_low, 1 + hi) * a)
                if clip_c > 0 and a < 0:
                    term = torch.minimum(term, torch.tensor(-clip_c * a, dtype=torch.float64))
                terms[t] = term
            terms[t] = terms[t] * weight[t]
            if kl_coef > 0:
                d = ref[i, t] - logp[i, t]
                k = {"k1": -d, "k2": 0.5 * d * d, "k3": torch.exp(d) - d - 1,
                     "low_var_kl": torch.clamp(torch.exp(d) - d - 1, -10, 10)}[kl_kind]
                terms[t] = terms[t] + kl_coef * k
            if ent_coef > 0:
                terms[t] = terms[t] - ent_coef * entropy[i, t]
        token_sum = sum(terms[t] for t in toks)
        if agg == "token_mean":
            total = total + w[i] * token_sum / n_tokens
        elif agg == "seq_mean_token_sum":
            total = total + w[i] * token_sum / n_samples
        elif agg == "seq_mean_token_mean":
            total = total + w[i] * (token_sum / len(toks)) / n_samples
        else:
            total = total + w[i] * token_sum / (n_samples * max_len)
    return total


VARIANTS = {
    "plain": {},
    "dual_clip": {"clip_ratio_c": 2.0},
    "tis_token": {"is_cap": 1.5},
    "mis_sequence": {"is_cap": 2.0, "is_level": "sequence", "is_mode": "mask"},
    "mis_token_low": {"is_cap": 1.3, "is_mode": "mask", "is_low": 0.8},
    "tis_sequence": {"is_cap": 1.2, "is_level": "sequence"},
    "kl_k2_entropy": {"kl_coef": 0.1, "kl_estimator": "k2", "entropy_coef": 0.01},
    "kl_low_var": {"kl_coef": 0.05, "kl_estimator": "low_var_kl"},
}


def ref_kwargs(kw):
    return {"clip_c": kw.get("clip_ratio_c", 0.0), "is_cap": kw.get("is_cap", 0.0),
            "is_level": kw.get("is_level", "token"), "is_mode": kw.get("is_mode", "truncate"),
            "is_low": kw.get("is_low", 0.0), "kl_coef": kw.get("kl_coef", 0.0), "kl_kind": kw.get("kl_estimator", "k3"),
            "ent_coef": kw.get("entropy_coef", 0.0)}


def ours(name, agg, kw, logp, behaviour, mask, adv, w, ref, entropy, *, n_tokens, n_samples):
    st = settings(name, agg, **kw)
    x = logp.clone().requires_grad_(True)
    ent = entropy.clone().requires_grad_(True)
    loss, sums, maxima = policy_loss(x, behaviour, mask, adv, w, batch_loss_tokens=n_tokens, batch_samples=n_samples,
                                     ref_logp=ref if st.kl_coef > 0 else None, entropy=ent, settings=st)
    loss.backward()
    return loss.detach(), x.grad, ent.grad, sums, maxima


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("name", OBJECTIVES)
def test_loss_and_gradient_match_the_published_formula(name, agg, variant):
    kw = VARIANTS[variant]
    if "clip_ratio_c" in kw and name in ("gspo", "cispo"):
        pytest.skip("no PPO token clip to dual-clip")
    seed = zlib.crc32(f"{name}/{agg}/{variant}".encode()) % 1000
    logp, behaviour, mask, adv, w, ref, entropy = random_batch(seed, agg=agg)
    n_tokens, n_samples = int(mask.sum()) + 5, logp.shape[0] + 2      # other replicas hold the rest
    loss, grad, ent_grad, _, _ = ours(name, agg, kw, logp, behaviour, mask, adv, w, ref, entropy,
                                      n_tokens=n_tokens, n_samples=n_samples)
    x = logp.clone().requires_grad_(True)
    e = entropy.clone().requires_grad_(True)
    expected = reference_loss(name, x, behaviour, mask, adv, w, agg=agg, n_tokens=n_tokens, n_samples=n_samples,
                              ref=ref, entropy=e, **ref_kwargs(kw))
    expected.backward()
    assert abs(float(loss) - float(expected.detach())) < 1e-10
    assert torch.allclose(grad, x.grad, atol=1e-10, rtol=0)
    assert torch.isfinite(grad).all() and (grad[~mask] == 0).all()
    if kw.get("entropy_coef"):
        assert torch.allclose(ent_grad, e.grad, atol=1e-10, rtol=0)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("name", OBJECTIVES)
def test_micro_batch_and_replica_splits_sum_to_the_one_batch_gradient(name, agg):
    kw = {"is_cap": 1.5} if name == "rloo" else {"kl_coef": 0.1} if name == "grpo" else {}
    logp, behaviour, mask, adv, w, ref, entropy = random_batch(7, rows=9, agg=agg)
    n_tokens, n_samples = int(mask.sum()), logp.shape[0]
    _, full, _, sums, _ = ours(name, agg, kw, logp, behaviour, mask, adv, w, ref, entropy,
                               n_tokens=n_tokens, n_samples=n_samples)
    # 2 replicas × micro-batches of 2 rows: each slice normalised by the whole batch's counts
    pieces = torch.zeros_like(full)
    total = torch.zeros_like(sums)
    for rows in ([0, 1], [2, 3], [4], [5, 6], [7, 8]):
        _, g, _, s, _ = ours(name, agg, kw, logp[rows], behaviour[rows], mask[rows], adv[rows], w[rows], ref[rows],
                             entropy[rows], n_tokens=n_tokens, n_samples=n_samples)
        pieces[rows] += g
        total += s
    assert torch.allclose(pieces, full, atol=1e-12, rtol=0)
    assert torch.allclose(total, sums, atol=1e-10, rtol=1e-12)


# ------------------------------------------------------------------------------------------------
# Hand-worked examples
# ------------------------------------------------------------------------------------------------

def two_samples():
    # Sample 0: A = +1, weight 1, tokens logp - behaviour = 0, 0.4, -0.5.  Sample 1: A = -0.5, weight 1,
    # logp - behaviour = -0.5, 0 and a padding position.
    logp = torch.tensor([[-1.0, -0.5, -2.0], [-0.6, -1.2, 9.0]], dtype=torch.float64)
    behaviour = torch.tensor([[-1.0, -0.9, -1.5], [-0.1, -1.2, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    return logp, behaviour, mask, torch.tensor([1.0, -0.5], dtype=torch.float64), torch.ones(2, dtype=torch.float64)


def hand(name, agg, **kw):
    logp, behaviour, mask, adv, w = two_samples()
    x = logp.clone().requires_grad_(True)
    loss, _, _ = policy_loss(x, behaviour, mask, adv, w, batch_loss_tokens=5, batch_samples=2,
                             settings=settings(name, agg, **kw))
    loss.backward()
    return float(loss.detach()), x.grad


E = math.exp


def test_hand_grpo():
    # clip 0.8..1.25. Sample 0 (A=1): 1, min(e^.4, 1.25) = 1.25, e^-.5. Sample 1 (A=-.5): max(e^-.5, .8)·.5
    # = .8·.5 (the lower clip binds), 1·.5.
    loss, grad = hand("grpo", "token_mean")
    assert loss == pytest.approx((-(1 + 1.25 + E(-0.5)) + (0.4 + 0.5)) / 5, abs=1e-12)
    assert grad[0].tolist() == pytest.approx([-1 / 5, 0.0, -E(-0.5) / 5])
    assert grad[1].tolist() == pytest.approx([0.0, 0.5 / 5, 0.0])


def test_hand_dr_grpo():
    # dr_grpo's advantages are the centred rewards; with these A the loss is grpo's token sum / (B · L_max).
    loss, _ = hand("dr_grpo", "seq_mean_token_sum_norm")
    assert loss == pytest.approx((-(1 + 1.25 + E(-0.5)) + 0.9) / (2 * L_MAX), abs=1e-12)


def test_hand_dapo():
    # clip-higher 1.28: e^.4 = 1.4918 is still clipped, at 1.28 now.
    loss, _ = hand("dapo", "token_mean")
    assert loss == pytest.approx((-(1 + 1.28 + E(-0.5)) + 0.9) / 5, abs=1e-12)


def test_hand_gspo():
    # s_0 = exp((0 + .4 - .5)/3) = e^(-1/30) < 1 - 3e-4: clipped, but A > 0 takes the min: -s_0.
    # s_1 = exp(-.25), A = -.5: -min(-.5 s_1, -.5 · .9997) = .5 · .9997 (the clip binds).
    loss, grad = hand("gspo", "seq_mean_token_mean")
    s0 = E(-0.1 / 3)
    assert loss == pytest.approx((-s0 + 0.5 * (1 - 3e-4)) / 2, abs=1e-12)
    # ∂/∂logp_t of -s_0/2 = -s_0/(2·3) for each of sample 0's tokens; sample 1 is clipped: 0.
    assert grad[0].tolist() == pytest.approx([-s0 / 6] * 3, abs=1e-12)
    assert grad[1].tolist() == pytest.approx([0.0, 0.0, 0.0], abs=1e-12)


def test_hand_cispo():
    # -sg(min(ρ, 1.2)) A logp: every loss token gets gradient -min(ρ, 1.2) A / N, except a token with A < 0
    # whose ratio fell below 1 - cispo_clip_low (MiniMax-M1's token mask): sample 1's first, ρ = e^-.5.
    loss, grad = hand("cispo", "token_mean", cispo_clip_high=1.2)
    r0 = [1.0, 1.2, E(-0.5)]                     # e^.4 capped at 1.2; A = 1 > 0: no mask
    r1 = [E(-0.5), 1.0]
    expected = (-(r0[0] * -1.0 + r0[1] * -0.5 + r0[2] * -2.0) + 0.5 * (r1[1] * -1.2)) / 5
    assert loss == pytest.approx(expected, abs=1e-12)
    assert grad[0].tolist() == pytest.approx([-r / 5 for r in r0], abs=1e-12)
    assert grad[1].tolist() == pytest.approx([0.0, 0.5 / 5, 0.0], abs=1e-12)
    # cispo_clip_low = 1: the paper's plain CISPO, no token is masked
    loss, grad = hand("cispo", "token_mean", cispo_clip_high=1.2, cispo_clip_low=1.0)
    expected = (-(r0[0] * -1.0 + r0[1] * -0.5 + r0[2] * -2.0) + 0.5 * (r1[0] * -0.6 + r1[1] * -1.2)) / 5
    assert loss == pytest.approx(expected, abs=1e-12)
    assert grad[1].tolist() == pytest.approx([0.5 * r1[0] / 5, 0.5 / 5, 0.0], abs=1e-12)


def test_hand_rloo():
    # rewards 1, 0, 0, 1 → leave-one-out baselines 1/3, 2/3, 2/3, 1/3: A = 2/3, -2/3, -2/3, 2/3
    assert group_advantages([1.0, 0.0, 0.0, 1.0], eps=1e-6, estimator="leave_one_out") == pytest.approx(
        [2 / 3, -2 / 3, -2 / 3, 2 / 3])
    loss, _ = hand("rloo", "token_mean")          # the loss is grpo's for given advantages
    assert loss == pytest.approx(hand("grpo", "token_mean")[0], abs=1e-15)


def test_hand_aggregations():
    # grpo per-token terms: sample 0: -1, -1.25, -e^-.5 (sum S0, 3 tokens); sample 1: .4, .5 (sum .9, 2 tokens)
    s0, s1 = -(1 + 1.25 + E(-0.5)), 0.9
    assert hand("grpo", "seq_mean_token_sum")[0] == pytest.approx((s0 + s1) / 2, abs=1e-12)
    assert hand("grpo", "seq_mean_token_mean")[0] == pytest.approx((s0 / 3 + s1 / 2) / 2, abs=1e-12)


# ------------------------------------------------------------------------------------------------
# TRL's GRPOTrainer._compute_loss, its own code path
# ------------------------------------------------------------------------------------------------

def trl_loss(loss_type, level, logp, old, mask, adv, eps_low, eps_high, max_len):
    """GRPOTrainer._compute_loss on a stand-in trainer: one process, no accumulation, no KL or entropy
    bonus, the log-probs given instead of a model's."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    class Accelerator:
        num_processes, sync_gradients = 1, True

        def gather(self, x):
            return x
        gather_for_metrics = gather

        def reduce(self, x, reduction="sum"):
            return x

    me = types.SimpleNamespace(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level=level, beta=0.0,
        loss_type=loss_type, epsilon_low=eps_low, epsilon_high=eps_high, use_vllm=False,
        vllm_importance_sampling_correction=False, model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=max_len, accelerator=Accelerator(),
        _entropy_bonus_enabled=False, aux_loss_enabled=False, _metrics={"train": defaultdict(list)},
        args=types.SimpleNamespace(delta=None, steps_per_generation=1, use_bias_correction_kl=False))
    me._get_per_token_logps_and_entropies = lambda *a, **k: (logp, torch.zeros_like(logp), None)
    b, s = logp.shape
    inputs = {"prompt_ids": torch.zeros(b, 1, dtype=torch.long), "prompt_mask": torch.ones(b, 1, dtype=torch.long),
              "completion_ids": torch.zeros(b, s, dtype=torch.long), "completion_mask": mask.long(),
              "advantages": adv, "old_per_token_logps": old, "num_items_in_batch": mask.sum().double()}
    return GRPOTrainer._compute_loss(me, None, inputs)


TRL_CASES = [  # (ours, loss_agg, TRL loss_type, TRL importance_sampling_level, ε_low, ε_high)
    ("grpo", "token_mean", "bnpo", "token", 0.2, 0.25),
    ("grpo", "token_mean", "dapo", "token", 0.2, 0.25),
    ("grpo", "seq_mean_token_mean", "grpo", "token", 0.2, 0.25),
    ("dr_grpo", "seq_mean_token_sum_norm", "dr_grpo", "token", 0.2, 0.25),
    ("dapo", "token_mean", "dapo", "token", 0.2, 0.28),
    ("gspo", "seq_mean_token_mean", "grpo", "sequence", 3e-4, 4e-4),
    ("cispo", "token_mean", "cispo", "token", 0.2, 5.0),
]


@pytest.mark.parametrize("name, agg, loss_type, level, eps_low, eps_high", TRL_CASES)
def test_equal_to_trl_grpo_trainer(name, agg, loss_type, level, eps_low, eps_high):
    pytest.importorskip("trl")
    logp, behaviour, mask, adv, _, _, _ = random_batch(11, agg=agg)
    logp = torch.where(mask, logp, torch.zeros_like(logp))       # TRL multiplies by the mask: finite pads
    behaviour = torch.where(mask, behaviour, torch.zeros_like(behaviour))
    if name == "gspo":        # ratios near 1, so that the narrow sequence clip binds for some rows only
        behaviour = torch.where(mask, logp + 0.003 * torch.sin(torch.arange(logp.numel()).view_as(logp).double()),
                                behaviour)
    w = torch.ones(logp.shape[0], dtype=torch.float64)        # TRL has no replay weights
    plain = {"cispo_clip_low": 1.0} if name == "cispo" else {}  # TRL's cispo has no token mask
    x = logp.clone().requires_grad_(True)
    ours_loss, _, _ = policy_loss(x, behaviour, mask, adv, w, batch_loss_tokens=int(mask.sum()),
                                  batch_samples=logp.shape[0], settings=settings(name, agg, **plain))
    ours_loss.backward()
    y = logp.clone().requires_grad_(True)
    theirs = trl_loss(loss_type, level, y, behaviour, mask, adv, eps_low, eps_high, L_MAX)
    theirs.backward()
    assert abs(float(ours_loss.detach()) - float(theirs.detach())) < 1e-12
    assert torch.allclose(x.grad, y.grad, atol=1e-12, rtol=0)


# ------------------------------------------------------------------------------------------------
# The pieces
# ------------------------------------------------------------------------------------------------

def test_dual_clip_caps_a_negative_advantage_only():
    logp = torch.tensor([[math.log(5.0), math.log(5.0), math.log(1.1)]], dtype=torch.float64, requires_grad=True)
    behaviour = torch.zeros(1, 3, dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    for a, expected_terms, expected_grad in [
            (-1.0, [3.0, 3.0, 1.1], [0.0, 0.0, 1.1]),      # ρ = 5: -min(-5, -1.25) = 5, capped at c|A| = 3
            (1.0, [-1.25, -1.25, -1.1], [0.0, 0.0, -1.1])]:   # A > 0: the dual clip does nothing
        x = logp.detach().clone().requires_grad_(True)
        loss, sums, _ = policy_loss(x, behaviour, mask, torch.tensor([a], dtype=torch.float64),
                                    torch.ones(1, dtype=torch.float64), batch_loss_tokens=3,
                                    settings=settings("grpo", "token_mean", clip_ratio_c=3.0))
        loss.backward()
        assert float(loss.detach()) == pytest.approx(sum(expected_terms) / 3, abs=1e-12)
        assert x.grad[0].tolist() == pytest.approx([g / 3 for g in expected_grad], abs=1e-12)
        assert loss_metrics(sums, torch.zeros(2, dtype=torch.float64))["clip_fraction"] == pytest.approx(2 / 3)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl"])
def test_kl_estimators(kind):
    logp = torch.tensor([-1.0, -2.0, -0.5, -30.0], dtype=torch.float64)
    ref = torch.tensor([-1.0, -1.5, -1.0, -0.1], dtype=torch.float64)
    got = kl_estimate(logp, ref, kind).tolist()
    for lp, rf, g in zip(logp.tolist(), ref.tolist(), got):
        d = rf - lp                           # log π_ref/π
        want = {"k1": -d, "k2": d * d / 2, "k3": math.exp(d) - d - 1,
                "low_var_kl": min(max(math.exp(min(max(d, -20), 20)) - min(max(d, -20), 20) - 1, -10), 10)}[kind]
        assert g == pytest.approx(want, rel=1e-12, abs=1e-12)
    assert kl_estimate(logp, logp, kind).abs().max() == 0        # no divergence from itself
    if kind == "low_var_kl":
        assert max(got) == 10.0                                   # d = 29.9 is clamped


def test_kl_in_the_loss_with_each_estimator_matches_its_coefficient():
    logp, behaviour, mask, adv, w, ref, entropy = random_batch(3)
    n = int(mask.sum())
    for kind in ("k1", "k2", "k3", "low_var_kl"):
        base, _, _ = policy_loss(logp, behaviour, mask, adv, w, batch_loss_tokens=n, ref_logp=ref,
                                 settings=settings("grpo", "token_mean"))
        with_kl, sums, maxima = policy_loss(logp, behaviour, mask, adv, w, batch_loss_tokens=n, ref_logp=ref,
                                            settings=settings("grpo", "token_mean", kl_coef=0.5, kl_estimator=kind))
        k = kl_estimate(logp, ref, kind)
        assert float(with_kl - base) == pytest.approx(0.5 * float((w[:, None] * k * mask).sum()) / n, abs=1e-12)
        assert loss_metrics(sums, maxima)["kl"] == pytest.approx(float((k * mask).sum()) / n, abs=1e-12)


def test_entropy_bonus_lowers_the_loss_by_its_weighted_mean():
    logp, behaviour, mask, adv, w, _, entropy = random_batch(4)
    n = int(mask.sum())
    base, _, _ = policy_loss(logp, behaviour, mask, adv, w, batch_loss_tokens=n, entropy=entropy,
                             settings=settings("grpo", "token_mean"))
    bonus, _, _ = policy_loss(logp, behaviour, mask, adv, w, batch_loss_tokens=n, entropy=entropy,
                              settings=settings("grpo", "token_mean", entropy_coef=0.1))
    assert float(base - bonus) == pytest.approx(0.1 * float((w[:, None] * entropy * mask).sum()) / n, abs=1e-12)


def test_truncated_and_masked_importance_weights_token_and_sequence():
    prox = torch.tensor([[0.0, math.log(3.0), math.log(0.5), 7.0]], dtype=torch.float64)
    beh = torch.zeros(1, 4, dtype=torch.float64)
    mask = torch.tensor([[True, True, True, False]])
    w, raw, capped = rollout_is_weights(prox, beh, mask, cap=2.0, level="token", mode="truncate")
    assert w[0, :3].tolist() == pytest.approx([1.0, 2.0, 0.5]) and capped[0].tolist() == [False, True, False, False]
    w, _, _ = rollout_is_weights(prox, beh, mask, cap=2.0, level="token", mode="mask")
    assert w[0, :3].tolist() == pytest.approx([1.0, 0.0, 0.5])
    # a lower bound masks the 0.5 as well, and counts it as changed
    w, _, capped = rollout_is_weights(prox, beh, mask, cap=2.0, level="token", mode="mask", low=0.6)
    assert w[0, :3].tolist() == pytest.approx([1.0, 0.0, 0.0]) and capped[0].tolist() == [False, True, True, False]
    # sequence: the product over loss tokens 1 · 3 · 0.5 = 1.5 (the pad's e^7 is not in it)
    w, raw, capped = rollout_is_weights(prox, beh, mask, cap=2.0, level="sequence", mode="truncate")
    assert raw[0, :3].tolist() == pytest.approx([1.5] * 3) and w[0, :3].tolist() == pytest.approx([1.5] * 3)
    w, _, capped = rollout_is_weights(prox, beh, mask, cap=1.2, level="sequence", mode="truncate")
    assert w[0, :3].tolist() == pytest.approx([1.2] * 3) and capped[0, :3].all()
    w, _, _ = rollout_is_weights(prox, beh, mask, cap=1.2, level="sequence", mode="mask")
    assert w[0, :3].tolist() == [0.0] * 3
    w, raw, capped = rollout_is_weights(prox, beh, mask, cap=0.0)        # off: weight 1, raw for the metrics
    assert (w == 1).all() and not capped.any() and raw[0, 1] == pytest.approx(3.0)


def test_rollout_is_metrics():
    logp = torch.tensor([[0.0, math.log(3.0), math.log(0.5)]], dtype=torch.float64)
    beh = torch.zeros(1, 3, dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    _, sums, maxima = policy_loss(logp, beh, mask, torch.ones(1, dtype=torch.float64),
                                  torch.ones(1, dtype=torch.float64), batch_loss_tokens=3,
                                  settings=settings("grpo", "token_mean", is_cap=2.0))
    m = loss_metrics(sums, maxima)
    assert m["rollout_is/mean"] == pytest.approx(4.5 / 3)
    assert m["rollout_is/max"] == pytest.approx(3.0)
    assert m["rollout_is/capped_fraction"] == pytest.approx(1 / 3)
    # against the proximal policy the ratio is 1: nothing is clipped, so ratio/mean is 1
    assert m["ratio/mean"] == pytest.approx(1.0) and m["clip_fraction"] == 0.0


def test_default_correction_is_off_and_the_ratio_is_against_the_behaviour_policy():
    logp, behaviour, mask, adv, w, _, _ = random_batch(5)
    a, _, _ = policy_loss(logp, behaviour, mask, adv, w, batch_loss_tokens=30, settings=settings("grpo", "token_mean"))
    b, _, _ = policy_loss(logp, behaviour, mask, adv, w, batch_loss_tokens=30, clip_low=0.2, clip_high=0.25)
    assert torch.equal(a, b)
    assert C.AlgorithmConfig().is_cap == 0.0 and C.AlgorithmConfig().clip_ratio_c == 0.0


@pytest.mark.parametrize("agg", AGGS)
def test_z_keeps_the_mean_weight_one_so_the_loss_scale_does_not_depend_on_replay(agg):
    # Every sample with the same per-token term: the loss must not change with how many are replayed.
    n = [3, 5, 2, 6]
    per_sample = agg == "seq_mean_token_mean"
    for replay in ([False] * 4, [False, True, False, True], [True, True, True, False]):
        w = loss_weights(replay, n, 0.5, per_sample=per_sample)
        if per_sample:
            assert sum(w) / len(w) == pytest.approx(1.0)
        else:
            assert sum(wi * ni for wi, ni in zip(w, n)) / sum(n) == pytest.approx(1.0)
        mask = torch.zeros(4, 6, dtype=torch.bool)
        for i, k in enumerate(n):
            mask[i, :k] = True
        logp = torch.full((4, 6), -1.0, dtype=torch.float64)
        loss, _, _ = policy_loss(logp, logp, mask, torch.ones(4, dtype=torch.float64),
                                 torch.tensor(w, dtype=torch.float64), batch_loss_tokens=sum(n), batch_samples=4,
                                 settings=settings("grpo", agg))
        # ratio 1, A = 1: every token's term is -1
        want = {"token_mean": -1.0, "seq_mean_token_sum": -sum(n) / 4, "seq_mean_token_mean": -1.0,
                "seq_mean_token_sum_norm": -sum(n) / (4 * L_MAX)}[agg]
        assert float(loss) == pytest.approx(want, abs=1e-12)


def test_advantage_estimators():
    r = [1.0, 0.0, 0.0, 0.0]
    assert group_advantages(r, eps=1e-6, estimator="group_centre") == pytest.approx([0.75, -0.25, -0.25, -0.25])
    loo = group_advantages(r, eps=1e-6, estimator="leave_one_out")
    for i, a in enumerate(loo):
        others = [x for j, x in enumerate(r) if j != i]
        assert a == pytest.approx(r[i] - sum(others) / len(others))
    assert group_advantages([1.0], eps=1e-6, estimator="leave_one_out") == [0.0]
    with pytest.raises(ValueError):
        group_advantages(r, eps=1e-6, estimator="nope")


# ------------------------------------------------------------------------------------------------
# Registry and config
# ------------------------------------------------------------------------------------------------

def test_builtin_objectives_agree_with_the_config_table():
    assert list(BUILTIN) == list(C.BUILTIN_OBJECTIVES)
    for name, cls in BUILTIN.items():
        assert (cls.advantage, cls.loss_agg) == C.BUILTIN_OBJECTIVES[name] and cls.name == name
        assert cls.__doc__ or __import__(cls.__module__).__doc__


def test_objective_traits_follow_the_objective_and_the_override():
    cfg = C.load(None, ["model.warmstart=true", "algorithm.name=dr_grpo"], check_files=False)
    assert C.objective_traits(cfg) == ("group_centre", "seq_mean_token_sum_norm")
    cfg = C.load(None, ["model.warmstart=true", "algorithm.name=gspo", "algorithm.loss_agg=token_mean"],
                 check_files=False)
    assert C.objective_traits(cfg) == ("group_norm", "token_mean")
    assert LossSettings.from_config(cfg).loss_agg == "token_mean"


@pytest.mark.parametrize("override, key", [
    ("algorithm.name=nope", "algorithm.name"),
    ("algorithm.group_size=1", "algorithm.group_size"),
    ("algorithm.clip_ratio_c=0.9", "algorithm.clip_ratio_c"),
    ("algorithm.is_cap=0.5", "algorithm.is_cap"),
    ("algorithm.loss_agg=seq_mean", "algorithm.loss_agg"),
    ("algorithm.is_level=batch", "algorithm.is_level"),
    ("algorithm.kl_estimator=k4", "algorithm.kl_estimator"),
    ("algorithm.is_low=0.5", "algorithm.is_low"),           # no correction to bound
])
def test_settings_that_cannot_work_fail_at_load_naming_the_key(override, key):
    sets = ["model.warmstart=true", override]
    if key == "algorithm.group_size":
        sets[1:1] = ["trainer.batch_size=8"]
    with pytest.raises(C.ConfigError) as e:
        C.load(None, sets, check_files=False)
    assert e.value.key == key and "\n" not in str(e.value)


def test_dual_clip_on_an_objective_without_a_token_clip_is_refused():
    with pytest.raises(C.ConfigError) as e:
        C.load(None, ["model.warmstart=true", "algorithm.name=cispo", "algorithm.clip_ratio_c=3"], check_files=False)
    assert e.value.key == "algorithm.clip_ratio_c"


def test_a_plugin_objective_is_valid_once_registered():
    name = "test_reinforce_objective"
    assert name not in plugins.objective_names()

    class Reinforce(Objective):
        advantage, loss_agg = "group_centre", "seq_mean_token_mean"

        def per_token_loss(self, logp, old_logp, mask, adv):
            ratio = torch.exp(torch.where(mask, logp - old_logp, torch.zeros_like(logp)))
            return PgTerms(-adv * ratio, ratio, torch.zeros_like(mask))

    try:
        with pytest.raises(C.ConfigError):
            C.load(None, ["model.warmstart=true", f"algorithm.name={name}"], check_files=False)
        plugins.register_objective(name)(Reinforce)
        cfg = C.load(None, ["model.warmstart=true", f"algorithm.name={name}"], check_files=False)
        assert C.objective_traits(cfg) == ("group_centre", "seq_mean_token_mean")
        st = LossSettings.from_config(cfg)
        assert isinstance(st.objective, Reinforce) and st.loss_agg == "seq_mean_token_mean"
    finally:
        plugins._OBJECTIVES.pop(name, None)


# ------------------------------------------------------------------------------------------------
# How a replayed sample enters each loss (the objective modules' "Replay" paragraphs)
# ------------------------------------------------------------------------------------------------

def _stale_sample():
    """One sample of 4 tokens: two from the version the trainer now has (ratio 1), two generated two
    versions back and since made 3x likelier (ratio 3): a replayed partial rollout."""
    behaviour = torch.tensor([[math.log(0.2), math.log(0.2), math.log(0.1), math.log(0.1)]], dtype=torch.float64)
    logp = torch.tensor([[math.log(0.2), math.log(0.2), math.log(0.3), math.log(0.3)]], dtype=torch.float64)
    return logp, behaviour, torch.ones(1, 4, dtype=torch.bool)


@pytest.mark.parametrize("name", ["grpo", "dapo", "dr_grpo", "rloo", "gspo", "cispo"])
def test_a_replayed_sample_trains_under_every_objective_in_mode_reflow(name):
    cfg = C.load(None, ["model.warmstart=true", f"algorithm.name={name}", "reflow.mode=reflow",
                        "reflow.sigma=0.5", "reflow.tau=0.5"], check_files=False)
    assert cfg.reflow.sigma == 0.5             # no objective refuses replay
    logp, behaviour, mask = _stale_sample()
    x = logp.clone().requires_grad_(True)
    adv, w = torch.ones(1, dtype=torch.float64), torch.full((1,), 0.5, dtype=torch.float64)
    loss, _, _ = policy_loss(x, behaviour, mask, adv, w, batch_loss_tokens=4, batch_samples=1,
                             settings=settings(name, C.BUILTIN_OBJECTIVES[name][1]))
    loss.backward()
    g = x.grad[0]
    if name == "cispo":       # the stale tokens keep their gradient, weighted by the capped ratio
        assert g[2] == pytest.approx(3 * g[0]) and g[0] != 0
    elif name == "gspo":      # s = exp(mean log ρ) = √3 is far outside 1 ± 4e-4: the clip takes the gradient
        assert torch.equal(g, torch.zeros(4, dtype=torch.float64))
    else:                     # PPO clip per token: ρ = 3 > 1 + ε with A > 0 clips the stale tokens only
        assert g[0] != 0 and g[2] == 0 and g[3] == 0


def test_gspo_sequence_ratio_over_tokens_of_several_versions_is_their_geometric_mean():
    logp, behaviour, mask = _stale_sample()
    terms = make_objective(algorithm("gspo")).per_token_loss(logp, behaviour, mask, torch.ones(1, 1))
    assert float(terms.ratio[0, 0]) == pytest.approx(math.sqrt(3.0), rel=1e-12)
