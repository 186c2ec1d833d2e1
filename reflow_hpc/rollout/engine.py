"""The rollout engine interface that workers drive (DESIGN §6).

It maps one to one onto vLLM's engine API so that the embedded ``torch`` engine and a ``vllm``
engine are interchangeable behind it:

| here                         | vLLM                                                         |
| ---------------------------- | ------------------------------------------------------------ |
| ``add(request)``             | ``LLMEngine.add_request(request_id, TokensPrompt, SamplingParams)`` |
| ``step() -> [Completion]``   | ``LLMEngine.step()`` → finished ``RequestOutput``s           |
| ``abort_all() -> [Completion]`` | ``abort_request(ids)`` after reading the partial outputs  |
| ``abort(ids)``               | ``abort_request(ids)``: those requests end, unreported       |
| ``load_weights(state, v)``   | ``collective_rpc("load_weights")`` / ``model.load_weights(iter)`` |
| ``sleep()`` / ``wake()``     | ``LLMEngine.sleep(level)`` / ``wake_up()``                   |
| ``set_concurrency_cap(n)``   | the scheduler's ``max_num_seqs`` in force                    |
| ``stats()``                  | scheduler stats: running, waiting, KV usage, preemptions     |

A request is one sample. A partial sample returned by ``abort_all`` can be added again with its
partial response as ``Request.response_prefix``; the engine re-prefills prompt + prefix under the
weights it holds now and continues, so one sample may carry tokens of several policy versions.
Such continuations are admitted before fresh prompts (:func:`enqueue`): their tokens age against δ
with every step they wait, and a sample handed over by a worker that left the rollout pool would
otherwise wait behind the receiver's whole queue.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Protocol, TypeVar, runtime_checkable

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64        # counts the whole response, prefix included
    stop_ids: tuple[int, ...] = ()  # generation ends after emitting one of these (it is kept)
    seed: int | None = None         # per-request seed; None = engine stream


@dataclass
class Request:
    request_id: int
    prompt: np.ndarray                       # int32 prompt token ids
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # Continuation of a partial sample: tokens already generated, their log-probs and versions
    # (a version of -1 marks an inserted, non-generated token such as a tool observation).
    response_prefix: np.ndarray | None = None
    prefix_logprobs: np.ndarray | None = None
    prefix_versions: np.ndarray | None = None


@dataclass
class Completion:
    request_id: int
    prompt: np.ndarray        # int32
    response: np.ndarray      # int32, prefix included
    logprobs: np.ndarray      # float32, aligned with response
    versions: np.ndarray      # int32, aligned with response
    finish_reason: str        # stop | length | abort

    def as_request(self, sampling: SamplingParams) -> Request:
        """The request that continues this (partial) completion."""
        return Request(self.request_id, self.prompt, sampling, self.response, self.logprobs, self.versions)


@dataclass
class EngineStats:
    running: int = 0
    queued: int = 0
    kv_tokens_used: int = 0
    kv_tokens_budget: int = 0
    preemptions: int = 0          # cumulative
    generated_tokens: int = 0     # cumulative
    prefilled_tokens: int = 0     # cumulative, re-prefills after an abort or preemption included (0: not counted)
    decode_steps: int = 0         # cumulative forwards that decoded a token per running request (0: not counted)
    version: int = 0


class LimitError(ValueError):
    """A ``[rollout]`` limit an engine cannot work with; names the key, the value and the rule."""

    def __init__(self, key: str, value: object, why: str):
        self.key, self.value, self.why = key, value, why
        super().__init__(f"{key} = {value!r}: {why}")


def check_limits(*, max_concurrency: int, kv_budget_tokens: int, max_model_len: int, max_prefill_tokens: int,
                 max_positions: int | None = None) -> int:
    """The rules of the ``[rollout]`` limits, shared by the config check (``max_positions`` unknown
    there) and the engines (which know their model's). Returns the effective max_model_len (0 means
    the model's length, capped at the KV budget); raises :class:`LimitError`."""
    if max_concurrency < 1:
        raise LimitError("rollout.max_concurrency", max_concurrency, "must be ≥ 1")
    if max_prefill_tokens < 1:
        raise LimitError("rollout.max_prefill_tokens", max_prefill_tokens, "must be ≥ 1")
    if max_model_len == 1:
        raise LimitError("rollout.max_model_len", 1, "must be 0 (the model's length) or ≥ 2")
    if max_model_len > kv_budget_tokens:
        raise LimitError("rollout.max_model_len", max_model_len,
                         f"must be ≤ rollout.kv_budget_tokens ({kv_budget_tokens}) so that one request always fits")
    if max_model_len == 0 and max_positions is not None:
        max_model_len = min(max_positions, kv_budget_tokens)
    if max_positions is not None and max_model_len > max_positions:
        raise LimitError("rollout.max_model_len", max_model_len,
                         f"must be ≤ the model's max_position_embeddings ({max_positions})")
    return max_model_len


def checked_request(request: Request, *, vocab_size: int, max_model_len: int) -> Request:
    """The checks every engine makes of a request (temperature, budget, prompt, prefix arrays, token
    range, length), as one-line errors naming the request; returns it with int32 prompt and prefix,
    float32 prefix log-probs and int32 prefix versions (zeros and -1 where the request had none)."""
    rid, sp = int(request.request_id), request.sampling
    if not sp.temperature >= 0:
        raise ValueError(f"request {rid}: temperature = {sp.temperature}: must be ≥ 0 (0 = greedy)")
    if sp.max_new_tokens < 1:
        raise ValueError(f"request {rid}: max_new_tokens = {sp.max_new_tokens}: must be ≥ 1")
    prompt = np.asarray(request.prompt)
    if prompt.ndim != 1 or len(prompt) == 0:
        raise ValueError(f"request {rid}: prompt must be a non-empty 1-D array of token ids, "
                         f"got shape {prompt.shape}")
    prefix = np.asarray(request.response_prefix if request.response_prefix is not None else [], dtype=np.int64)
    n = len(prefix)
    lp = np.zeros(n, np.float32) if request.prefix_logprobs is None else np.asarray(request.prefix_logprobs)
    ver = np.full(n, -1, np.int32) if request.prefix_versions is None else np.asarray(request.prefix_versions)
    if lp.shape != (n,) or ver.shape != (n,):
        raise ValueError(f"request {rid}: response_prefix has {n} tokens but prefix_logprobs has "
                         f"{lp.shape} and prefix_versions {ver.shape}")
    tokens = np.concatenate([prompt.astype(np.int64), prefix])
    if tokens.min() < 0 or tokens.max() >= vocab_size:
        raise ValueError(f"request {rid}: token ids must be in [0, {vocab_size}), "
                         f"got [{tokens.min()}, {tokens.max()}]")
    if len(tokens) > max_model_len:
        raise ValueError(f"request {rid}: prompt + prefix = {len(tokens)} tokens exceeds "
                         f"rollout.max_model_len ({max_model_len})")
    return Request(rid, prompt.astype(np.int32), sp, prefix.astype(np.int32), lp.astype(np.float32),
                   ver.astype(np.int32))


Q = TypeVar("Q")


def enqueue(queue: deque[Q], item: Q, continues: Callable[[Q], bool]) -> None:
    """Queue ``item`` for admission: a continuation (``continues``: it carries generated tokens) goes
    after the queued continuations and ahead of every fresh prompt; a fresh prompt goes last."""
    if not continues(item):
        queue.append(item)
        return
    i = len(queue)
    while i and not continues(queue[i - 1]):
        i -= 1
    queue.insert(i, item)


@runtime_checkable
class Engine(Protocol):
    version: int

    def add(self, request: Request) -> None: ...

    def step(self) -> list[Completion]: ...

    def abort_all(self) -> list[Completion]: ...

    def abort(self, request_ids: Iterable[int]) -> None: ...

    def load_weights(self, state: Mapping[str, "object"] | Iterable[tuple[str, "object"]], version: int) -> None: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...

    def set_concurrency_cap(self, cap: int) -> None: ...

    def stats(self) -> EngineStats: ...

    def has_unfinished(self) -> bool: ...
