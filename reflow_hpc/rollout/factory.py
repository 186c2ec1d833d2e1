"""Building a rollout engine and its default sampling parameters from the ``[rollout]`` section."""

from __future__ import annotations

from ..config import Config, ConfigError, RolloutConfig, validator
from .engine import Engine, SamplingParams


@validator
def _check_rollout(cfg: Config) -> None:
    r = cfg.rollout
    if r.max_model_len == 1:
        raise ConfigError("rollout.max_model_len", 1, "must be 0 (the model's length) or ≥ 2")
    if r.max_model_len > r.kv_budget_tokens:
        raise ConfigError("rollout.max_model_len", r.max_model_len,
                          f"must be ≤ rollout.kv_budget_tokens ({r.kv_budget_tokens}) so that one request always fits")


def build_engine(model, cfg: RolloutConfig, *, device: str = "cpu", seed: int = 0, version: int = 0) -> Engine:
    """The engine named by ``cfg.engine`` over ``model`` (a ``transformers`` causal LM), on ``device``.

    ``seed`` should be the run's seed on every worker: with globally unique request ids, a sample's
    tokens then do not depend on which worker generated it.
    """
    if cfg.engine == "torch":
        from .torch_engine import TorchEngine
        return TorchEngine.from_config(model, cfg, device=device, seed=seed, version=version)
    raise ConfigError("rollout.engine", cfg.engine, "this factory builds the torch engine only")


def sampling_params(cfg: RolloutConfig, stop_ids: tuple[int, ...] = (), seed: int | None = None) -> SamplingParams:
    """Sampling parameters of a sample from the config (stop ids come from the task's tokenizer)."""
    return SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
                          stop_ids=tuple(int(s) for s in stop_ids), seed=seed)
