"""The policy as a Hugging Face model directory: build the tiny CPU Qwen3, load, save.

- ``build_tiny_policy(cfg)`` builds a ``Qwen3ForCausalLM`` from the ``model.tiny_*`` keys (1–10 M
  parameters at the defaults' scale) over the character or byte tokenizer of :mod:`reflow_hpc.envs.tokenizer` (``model.tiny_tokenizer``),
  initialised from ``run.seed``; nothing is downloaded.
- ``save_policy(model, tokenizer, dir)`` writes a standard directory (``config.json``,
  ``generation_config.json``, ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``)
  into a temporary sibling and renames it into place, so a crash never leaves a half-written
  directory with a ``config.json`` that looks valid.
- ``build_random_policy(cfg)`` builds the architecture of a Hugging Face ``config.json``
  (``model.init_config``) with random weights over the same tokenizer: a real model's size, no download.
- ``load_policy(path, dtype, device)`` loads any such directory with local files only, in eval mode.

torch and transformers are imported inside the functions, so importing this module is cheap.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import ConfigError
from .private import private_dir

if TYPE_CHECKING:
    from .config import Config

_DTYPES = ("float32", "bfloat16", "float16")


def tiny_qwen3_config(cfg: "Config", tokenizer: Any) -> Any:
    """The ``Qwen3Config`` of the tiny policy (architecture keys ``model.tiny_*``)."""
    from transformers import Qwen3Config

    m = cfg.model
    if m.tiny_heads % m.tiny_kv_heads:
        raise ConfigError("model.tiny_kv_heads", m.tiny_kv_heads, f"must divide model.tiny_heads ({m.tiny_heads})")
    return Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=m.tiny_hidden_size, intermediate_size=m.tiny_intermediate_size,
        num_hidden_layers=m.tiny_layers, num_attention_heads=m.tiny_heads, num_key_value_heads=m.tiny_kv_heads,
        head_dim=m.tiny_head_dim, max_position_embeddings=m.tiny_max_positions, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id)


def build_tiny_policy(cfg: "Config") -> tuple[Any, Any]:
    """(model, tokenizer): a freshly initialised tiny Qwen3 and its character tokenizer."""
    import torch
    from transformers import GenerationConfig, Qwen3ForCausalLM

    from .envs.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(cfg.model.tiny_tokenizer, cfg.model.tiny_max_positions)
    config = tiny_qwen3_config(cfg, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.run.seed)
        model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, do_sample=False)
    return model, tokenizer


def build_random_policy(cfg: "Config") -> tuple[Any, Any]:
    """(model, tokenizer): the architecture of ``model.init_config`` (a Hugging Face ``config.json``) with
    random weights from ``run.seed``, over the character tokenizer (its ids fit any larger vocabulary).
    The shape and cost of a real model where nothing can be downloaded; its outputs are noise."""
    import json

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from .envs.tokenizer import build_char_tokenizer

    src = Path(cfg.model.init_config)
    try:
        raw = json.loads(src.read_text())
        config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError("model.init_config", str(src), f"not a Hugging Face model config: {e}") from None
    tokenizer = build_char_tokenizer(int(getattr(config, "max_position_embeddings", 256) or 256))
    if config.vocab_size < len(tokenizer):
        raise ConfigError("model.init_config", str(src), f"vocab_size {config.vocab_size} is smaller than the "
                                                          f"character tokenizer's {len(tokenizer)}")
    config.pad_token_id, config.bos_token_id = tokenizer.pad_token_id, tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.run.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, cfg.model.dtype))
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, do_sample=False)
    return model, tokenizer


def num_parameters(model: Any) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())


@contextlib.contextmanager
def no_progress_bars():
    """Silence transformers' progress bars (one small shard: a bar per load is only noise)."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def save_policy(model: Any, tokenizer: Any, directory: str | os.PathLike) -> Path:
    """Write model + tokenizer to ``directory`` atomically (temporary sibling, then rename)."""
    final = Path(directory)
    if not final.parent.is_dir():         # an existing parent may be shared (a group's models directory)
        private_dir(final.parent, what="policy directory")
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    old = final.parent / f".{final.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        # Made here, exclusively: a symlink planted at the name fails this instead of receiving the weights.
        tmp.mkdir(mode=0o700)
        with no_progress_bars():
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
        if final.exists():
            # A directory cannot be renamed over a non-empty one: move the old one aside first.
            final.rename(old)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return final


def load_policy(path: str | os.PathLike, dtype: str = "float32", device: str = "cpu") -> tuple[Any, Any]:
    """(model, tokenizer) from a local Hugging Face directory, in eval mode on ``device``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, not {dtype!r}")
    p = Path(path)
    if not (p / "config.json").is_file():
        why = "no such directory" if not p.exists() else "no config.json in this directory"
        raise FileNotFoundError(f"policy {p}: {why}")
    with no_progress_bars():
        model = AutoModelForCausalLM.from_pretrained(p, dtype=getattr(torch, dtype), local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(p, local_files_only=True)
    return model.to(device).eval(), tokenizer
