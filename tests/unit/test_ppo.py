"""ppo's arithmetic (reflow_hpc/train/gae.py) against plain float64 loops and hand-worked numbers; the "none"
estimator, the per-token advantage in the loss, the registry and the config rules of ppo and [critic]."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import reflow_hpc.config as C
from reflow_hpc.core.advantages import group_advantages
from reflow_hpc.train import gae
from reflow_hpc.train.loss import LossSettings, kl_of_log_ratio, policy_loss
from reflow_hpc.train.objectives import BUILTIN, make_objective


def random_rows(seed: int, rows: int = 9, width: int = 14):
    """Rows with a prompt (no loss), response tokens, a tool-observation hole in some rows, right padding
    (no loss, garbage values) and a row without any loss token."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, width, generator=g, dtype=torch.float64)
    kl = torch.rand(rows, width, generator=g, dtype=torch.float64)
    reward = torch.randn(rows, generator=g, dtype=torch.float64)
    mask = torch.zeros(rows, width, dtype=torch.bool)
    for b in range(rows - 1):
        prompt = int(torch.randint(1, 4, (1,), generator=g))
        end = int(torch.randint(prompt + 2, width + 1, (1,), generator=g))
        mask[b, prompt:end] = True
        if end - prompt > 5 and b % 2:
            mask[b, prompt + 2:prompt + 4] = False           # a tool observation
    values[~mask] = 1e6                                       # never read
    return values, kl, reward, mask


def loop_gae(values, rewards_per_row, mask, gamma, lam, kl=None, beta=0.0):
    """Plain float64 GAE over each row's loss tokens, written from the paper's recursion."""
    rows, width = mask.shape
    adv = np.zeros((rows, width))
    ret = np.zeros((rows, width))
    for b in range(rows):
        idx = [t for t in range(width) if mask[b, t]]
        r = [(-beta * float(kl[b, t]) if kl is not None else 0.0) for t in idx]
        if idx:
            r[-1] += float(rewards_per_row[b])
        v = [float(values[b, t]) for t in idx]
        a_next = 0.0
        for k in reversed(range(len(idx))):
            v_next = v[k + 1] if k + 1 < len(idx) else 0.0
            a_next = r[k] + gamma * v_next - v[k] + gamma * lam * a_next
            adv[b, idx[k]] = a_next
            ret[b, idx[k]] = a_next + v[k]
    return adv, ret


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.0, 0.7)])
@pytest.mark.parametrize("with_kl", [False, True])
def test_gae_matches_a_plain_loop_over_loss_tokens(gamma, lam, with_kl):
    values, kl, reward, mask = random_rows(int(gamma * 100 + lam * 10) + with_kl)
    beta = 0.05 if with_kl else 0.0
    rewards = gae.token_rewards(mask, reward, kl if with_kl else None, beta)
    adv, ret = gae.gae(values, rewards, mask, gamma, lam)
    want_adv, want_ret = loop_gae(values.numpy(), reward.numpy(), mask.numpy(), gamma, lam,
                                  kl.numpy() if with_kl else None, beta)
    assert adv.dtype == ret.dtype == torch.float64
    assert np.max(np.abs(adv.numpy() - want_adv)) < 1e-10
    assert np.max(np.abs(ret.numpy() - want_ret)) < 1e-10
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()
    assert (adv[-1] == 0).all()                                # the row without loss tokens


def test_gae_hand_worked_example_skips_a_tool_observation():
    # Positions: prompt, loss, loss, tool observation, loss, padding. V at the loss tokens 0.5, 0.2, 0.4;
    # reward 1 at the last loss token; γ = 0.9, λ = 0.8.
    mask = torch.tensor([[False, True, True, False, True, False]])
    values = torch.tensor([[9.0, 0.5, 0.2, 7.0, 0.4, 5.0]], dtype=torch.float64)
    rewards = gae.token_rewards(mask, torch.tensor([1.0]))
    assert rewards.tolist() == [[0, 0, 0, 0, 1.0, 0]]
    adv, ret = gae.gae(values, rewards, mask, 0.9, 0.8)
    # δ3 = 1 - 0.4 = 0.6; δ2 = 0.9·0.4 - 0.2 = 0.16, A2 = 0.16 + 0.72·0.6 = 0.592;
    # δ1 = 0.9·0.2 - 0.5 = -0.32, A1 = -0.32 + 0.72·0.592 = 0.10624
    assert adv[0].tolist() == pytest.approx([0, 0.10624, 0.592, 0, 0.6, 0], abs=1e-12)
    assert ret[0].tolist() == pytest.approx([0, 0.60624, 0.792, 0, 1.0, 0], abs=1e-12)


def test_reward_goes_to_the_last_loss_token_and_kl_to_every_loss_token():
    mask = torch.tensor([[False, True, True, False], [False, False, False, False]])
    kl = torch.tensor([[5.0, 1.0, 2.0, 3.0], [1.0, 1.0, 1.0, 1.0]])
    r = gae.token_rewards(mask, torch.tensor([2.0, 3.0]), kl, 0.1)
    assert r[0].tolist() == pytest.approx([0, -0.1, 2.0 - 0.2, 0]) and r[1].tolist() == [0, 0, 0, 0]


def test_clipped_value_loss_against_the_hand_formula():
    v = torch.tensor([[1.0, 0.0, 0.0, 0.4, 3.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[0.5, 0.1, 0.5, 0.4, 0.0]], dtype=torch.float64)
    ret = torch.tensor([[0.0, 1.0, 0.0, 1.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, True, False]])
    loss, clipped = gae.value_loss(v, old, ret, mask, 0.2)
    # 1: max(1, 0.7²) = 1; 2: max(1, 1) = 1; 3: V moved 0.5 towards R, past ε: max(0, 0.3²) = 0.09 (clipped);
    # 4: V = V_old: (0.4 - 1)² = 0.36; 5: padding.
    assert loss[0].tolist() == pytest.approx([0.5, 0.5, 0.045, 0.18, 0.0], abs=1e-12)
    assert clipped[0].tolist() == [False, False, True, False, False]
    loss.sum().backward()
    assert v.grad[0].tolist() == pytest.approx([1.0, -1.0, 0.0, -0.6, 0.0], abs=1e-12)   # clipped: no gradient
    plain, none = gae.value_loss(v, old, ret, mask, 0.0)
    assert plain[0].tolist() == pytest.approx([0.5, 0.5, 0.0, 0.18, 0.0]) and not none.any()
    # Random tensors against the formula written out.
    g = torch.Generator().manual_seed(3)
    v, old, ret = (torch.randn(6, 8, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.rand(6, 8, generator=g) > 0.3
    loss, clipped = gae.value_loss(v, old, ret, mask, 0.15)
    want = 0.5 * torch.maximum((v - ret) ** 2, (torch.clamp(v, old - 0.15, old + 0.15) - ret) ** 2) * mask
    assert torch.allclose(loss, want, atol=1e-12, rtol=0)


def test_whitening_over_micro_batches_equals_one_batch():
    g = torch.Generator().manual_seed(5)
    adv = torch.randn(10, 12, generator=g, dtype=torch.float64) * 3 + 1
    mask = torch.rand(10, 12, generator=g) > 0.4
    whole = gae.whiten(adv, mask, gae.moments(adv, mask), 1e-6)
    sel = whole[mask]
    assert abs(float(sel.mean())) < 1e-12 and abs(float(sel.std(unbiased=False)) - 1) < 1e-6
    # Two "replicas", micro-batches of 3 rows: the moments summed over all of them (the all-reduce).
    pieces = [list(range(i, min(i + 3, 10))) for i in range(0, 10, 3)]
    total = sum(gae.moments(adv[p], mask[p]) for p in pieces)
    for p in pieces:
        assert torch.allclose(gae.whiten(adv[p], mask[p], total, 1e-6), whole[p], atol=1e-12, rtol=0)


def test_explained_variance():
    g = torch.Generator().manual_seed(8)
    ret = torch.randn(5, 7, generator=g, dtype=torch.float64)
    val = ret + 0.3 * torch.randn(5, 7, generator=g, dtype=torch.float64)
    mask = torch.rand(5, 7, generator=g) > 0.3
    r, v = ret[mask].numpy(), val[mask].numpy()
    e = (ret - val) * mask
    sums = {"tokens": float(mask.sum()), "returns": float((ret * mask).sum()),
            "returns_sq": float((ret * ret * mask).sum()), "residual": float(e.sum()),
            "residual_sq": float((e * e).sum())}
    assert gae.explained_variance(sums) == pytest.approx(1 - np.var(r - v) / np.var(r), abs=1e-12)
    perfect = dict(sums, residual=0.0, residual_sq=0.0)
    assert gae.explained_variance(perfect) == 1.0
    assert math.isnan(gae.explained_variance(dict(sums, returns_sq=sums["returns"] ** 2 / sums["tokens"])))


def test_none_estimator_gives_zeros():
    assert group_advantages([1.0, 0.0, 3.0], eps=1e-6, estimator="none") == [0.0, 0.0, 0.0]
    assert group_advantages([1.0], eps=1e-6, estimator="none") == [0.0]


def test_a_per_token_advantage_that_is_constant_per_row_is_the_per_sample_loss():
    alg = C.AlgorithmConfig()
    alg.name, alg.clip_low, alg.clip_high = "ppo", 0.2, 0.25
    st = LossSettings(objective=make_objective(alg))
    g = torch.Generator().manual_seed(2)
    logp = torch.randn(4, 6, generator=g, dtype=torch.float64) - 1
    beh = logp + 0.3 * torch.randn(4, 6, generator=g, dtype=torch.float64)
    mask = torch.rand(4, 6, generator=g) > 0.3
    adv, w = torch.randn(4, generator=g, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    outs = []
    for a in (adv, adv[:, None].expand(4, 6).clone()):
        x = logp.clone().requires_grad_(True)
        loss, sums, _ = policy_loss(x, beh, mask, a, w, batch_loss_tokens=int(mask.sum()), settings=st)
        loss.backward()
        outs.append((float(loss.detach()), x.grad, sums))
    assert outs[0][0] == pytest.approx(outs[1][0], abs=1e-14)
    assert torch.equal(outs[0][1], outs[1][1])


def test_ppo_is_registered_with_its_estimator():
    assert BUILTIN["ppo"].uses_critic and C.BUILTIN_OBJECTIVES["ppo"] == ("none", "token_mean")
    assert not any(cls.uses_critic for name, cls in BUILTIN.items() if name != "ppo")
    cfg = C.load(None, ["model.warmstart=true", "algorithm.name=ppo", "algorithm.group_size=1",
                        "trainer.batch_size=8"], check_files=False)
    assert C.objective_traits(cfg) == ("none", "token_mean")
    cfg = C.load(None, ["model.warmstart=true", "algorithm.name=ppo", "algorithm.kl_coef=0.1",
                        "algorithm.kl_in_reward=true"], check_files=False)
    assert LossSettings.from_config(cfg).kl_coef == 0.0       # the KL is in the reward, not in the loss
    cfg = C.load(None, ["model.warmstart=true", "algorithm.name=ppo", "algorithm.kl_coef=0.1"], check_files=False)
    assert LossSettings.from_config(cfg).kl_coef == 0.1
    assert kl_of_log_ratio(torch.tensor([0.0]), "k3").item() == 0.0


@pytest.mark.parametrize("sets, key", [
    (["algorithm.name=ppo", "algorithm.kl_in_reward=true"], "algorithm.kl_in_reward"),
    (["algorithm.name=grpo", "algorithm.kl_coef=0.1", "algorithm.kl_in_reward=true"], "algorithm.kl_in_reward"),
    (["algorithm.name=ppo", "trainer.steps=5", "critic.warmup_steps=5"], "critic.warmup_steps"),
    (["algorithm.name=ppo", "trainer.steps=5", "critic.lr_warmup_steps=6"], "critic.lr_warmup_steps"),
    (["algorithm.name=ppo", "algorithm.gae_lambda=1.5"], "algorithm.gae_lambda"),
    (["algorithm.name=ppo", "critic.value_clip=-1"], "critic.value_clip"),
    (["algorithm.name=ppo", "critic.schedule=linear"], "critic.schedule"),
])
def test_ppo_settings_that_cannot_work_fail_at_load_naming_the_key(sets, key):
    with pytest.raises(C.ConfigError) as e:
        C.load(None, ["model.warmstart=true", *sets], check_files=False)
    assert e.value.key == key and "\n" not in str(e.value)


def test_critic_section_round_trips_through_toml(tmp_path):
    cfg = C.load(None, ["model.warmstart=true", "algorithm.name=ppo", "critic.lr=2e-5", "critic.warmup_steps=3"],
                 check_files=False)
    path = tmp_path / "c.toml"
    path.write_text(C.to_toml(cfg))
    again = C.load(str(path), check_files=False)
    assert (again.critic.lr, again.critic.warmup_steps, again.critic.whiten_advantages) == (2e-5, 3, True)
