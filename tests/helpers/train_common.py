"""Shared pieces of the trainer tests: a tiny random Qwen3, a config, and GRPO batches of samples.

Batches look like what the coordinator hands a trainer: groups of samples with rewards,
group-normalised advantages, a replay flag on some samples and weights normalised with τ over the
whole batch (``reflow_hpc.core.mixing.loss_weights``). Behaviour log-probs are the model's own
(temperature-scaled) log-probs plus noise, so ratios spread around 1 and some tokens get clipped;
some responses carry a tool observation (version -1) in the middle.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from reflow_hpc.config import Config
from reflow_hpc.core.advantages import group_advantages
from reflow_hpc.core.mixing import loss_weights
from reflow_hpc.train.loss import token_logprobs
from reflow_hpc.train.trainer import WeightedSample
from reflow_hpc.trajectory import Trajectory

VOCAB = 96


def tiny_model(seed: int = 0, *, layers: int = 2, hidden: int = 64):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=128, tie_word_embeddings=True, pad_token_id=0,
                         bos_token_id=1, eos_token_id=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    return model


def make_config(**trainer) -> Config:
    cfg = Config()
    cfg.trainer.steps = 10
    cfg.trainer.batch_size = 8
    cfg.trainer.micro_batch_size = 3
    cfg.trainer.lr = 1e-3
    cfg.trainer.grad_clip = 1.0
    cfg.trainer.allreduce_bucket_mb = 0.02      # several gradient buckets for the tiny model
    cfg.rollout.temperature = 0.8
    cfg.algorithm.clip_low = 0.2
    cfg.algorithm.clip_high = 0.28
    for k, v in trainer.items():
        setattr(cfg.trainer, k, v)
    return cfg


def make_batch(model, cfg: Config, *, seed: int, groups: int = 2, group_size: int = 4, replay: int = 2,
               tau: float = 0.5, noise: float = 0.15) -> list[WeightedSample]:
    """``groups × group_size`` samples, the last ``replay`` of them replayed."""
    rng = np.random.default_rng(seed)
    trajs, advantages = [], []
    sid = 0
    for g in range(groups):
        prompt = rng.integers(3, VOCAB, size=int(rng.integers(2, 6)))
        rewards = rng.integers(0, 2, size=group_size).astype(float)
        if rewards.min() == rewards.max():
            rewards[0] = 1.0 - rewards[0]
        advantages += group_advantages(list(rewards), eps=1e-6)
        for r in rewards:
            resp = rng.integers(3, VOCAB, size=int(rng.integers(3, 12)))
            tokens = np.concatenate([prompt, resp]).astype(np.int32)
            versions = np.full(len(tokens), -1, dtype=np.int32)
            versions[len(prompt):] = 3
            if len(resp) > 6 and rng.random() < 0.5:        # a tool observation inside the response
                versions[len(prompt) + 2:len(prompt) + 4] = -1
            trajs.append(Trajectory(sid, g, g, tokens, np.zeros(len(tokens), np.float32), versions,
                                    len(prompt), reward=float(r)))
            sid += 1
    set_behaviour_logprobs(model, trajs, cfg.rollout.temperature, noise, rng)
    is_replay = [i >= len(trajs) - replay for i in range(len(trajs))]
    weights = loss_weights(is_replay, [t.num_loss_tokens for t in trajs], tau)
    return [WeightedSample(t, a, w, r) for t, a, w, r in zip(trajs, advantages, weights, is_replay)]


def set_behaviour_logprobs(model, trajs, temperature: float, noise: float, rng) -> None:
    with torch.no_grad():
        for t in trajs:
            ids = torch.as_tensor(t.tokens, dtype=torch.long)[None]
            logits = model(input_ids=ids, use_cache=False).logits
            logp, _ = token_logprobs(logits[:, :-1], ids[:, 1:], temperature)
            lp = np.zeros(len(t.tokens), np.float32)
            lp[1:] = logp[0].numpy() + rng.normal(0, noise, size=len(t.tokens) - 1)
            t.logprobs = np.where(t.versions >= 0, lp, 0.0).astype(np.float32)


def loss_tokens(items) -> int:
    return sum(it.trajectory.num_loss_tokens for it in items)


def params_digest(model) -> str:
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def max_param_diff(a, b) -> float:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return max(float((pa[n].detach() - pb[n].detach()).abs().max()) for n in pa)
