"""Samples through an engine and their task's environment: the rollout side of a worker.

One engine request per model turn. When a turn ends on a tool-call stop token of a multi-turn task,
the environment's observation is appended to the response (version −1, log-prob 0: not generated,
no loss) and the same sample continues as a new request whose prefix is everything so far. A
single-turn sample is one request. Rewards are computed here, on the worker that owns the sample.

Partial rollout (DESIGN §6): :meth:`EpisodeRunner.interrupt` moves every in-flight request to a
holding queue (``engine.abort_all``); after the weights are loaded :meth:`EpisodeRunner.resume`
re-adds them, and the engine re-prefills prompt + partial response under the new weights, so one
sample may carry tokens of several versions.

Hand-off (a worker leaving rollout): :meth:`EpisodeRunner.hand_off` returns every sample in flight as
a partial trajectory with its episode's state; :meth:`EpisodeRunner.resume_partial` on another
worker continues it the same way, under that worker's weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..envs.task import Episode, Prompt, Task, prompt_token_ids
from ..trajectory import NOT_GENERATED, Trajectory
from .engine import Completion, Engine, Request, SamplingParams


@dataclass
class _Sample:
    sample_id: int
    group_id: int
    prompt_id: int
    prompt: Prompt
    prompt_tokens: np.ndarray
    episode: Episode
    turn_start: int = 0       # response index where the current model turn began
    handed_from: int = -1     # the worker that began it and handed it over (-1: begun here)


class EpisodeRunner:
    def __init__(self, engine: Engine, task: Task, tokenizer: Any, sampling: SamplingParams, *, owner: int,
                 chat_template: bool = False):
        self.engine, self.task, self.tokenizer = engine, task, tokenizer
        self.owner = owner
        self.chat_template = chat_template
        self.stop_ids = tuple(task.stop_token_ids(tokenizer))
        self.turn_end_ids = frozenset(self.stop_ids) - {tokenizer.eos_token_id}
        self.sampling = SamplingParams(sampling.temperature, sampling.top_p, sampling.max_new_tokens,
                                       tuple(dict.fromkeys(sampling.stop_ids + self.stop_ids)), sampling.seed)
        self._live: dict[int, _Sample] = {}
        self._held: list[Completion] = []
        self._cancelled: set[int] = set()
        self.turns_completed = 0
        self.failed: list[tuple[int, str]] = []   # (sample id, error) of samples whose environment failed

    # -- inbound -------------------------------------------------------------------------------

    def add(self, sample_id: int, group_id: int, prompt_id: int, split: str = "train",
            prompt: Prompt | None = None) -> None:
        """Start sample ``sample_id`` on the task's prompt ``prompt_id`` of ``split`` (or on ``prompt``)."""
        prompt = prompt if prompt is not None else self.task.prompt(prompt_id, split)
        tokens = np.asarray(prompt_token_ids(self.tokenizer, prompt, self.chat_template), dtype=np.int32)
        self._live[sample_id] = _Sample(sample_id, group_id, prompt_id, prompt, tokens, self.task.start(prompt))
        self.engine.add(Request(sample_id, tokens, self.sampling))

    def cancel(self, sample_ids: Any) -> None:
        """These samples ended at the coordinator: finish them silently (the engine may still run them)."""
        for sid in sample_ids:
            if sid in self._live:
                self._cancelled.add(sid)

    # -- work ------------------------------------------------------------------------------------

    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    @property
    def in_flight(self) -> int:
        return len(self._live)

    def step(self) -> list[Trajectory]:
        """One engine step; returns the samples whose episode ended (reward computed)."""
        done: list[Trajectory] = []
        for c in self.engine.step():
            try:
                traj = self._on_turn_end(c)
            except Exception as e:       # a broken reward or tool ends this sample, not the worker
                self._drop(c.request_id)
                self.failed.append((c.request_id, f"{type(e).__name__}: {e}"))
                continue
            if traj is not None:
                done.append(traj)
        return done

    def interrupt(self) -> int:
        """Hold every in-flight request (before a weight load); returns how many."""
        self._held = self.engine.abort_all()
        return len(self._held)

    def resume(self) -> None:
        """Continue held requests under the weights the engine holds now."""
        held, self._held = self._held, []
        for c in held:
            if c.request_id in self._cancelled:
                self._drop(c.request_id)
                continue
            self.engine.add(c.as_request(self.sampling))

    def hand_off(self) -> list[Trajectory]:
        """Stop generating and return every sample in flight as a partial trajectory: prompt and response
        so far with their log-probs and per-token versions, the episode's state in ``meta["handoff"]``.
        Another worker continues it with :meth:`resume_partial`. The runner is empty afterwards."""
        held, self._held = self._held + self.engine.abort_all(), []
        out = []
        for c in held:
            s = self._live.pop(c.request_id, None)
            if s is None or c.request_id in self._cancelled:
                continue                     # ended at the coordinator meanwhile: nothing to hand over
            p = len(s.prompt_tokens)
            ep = s.episode
            out.append(Trajectory(
                sample_id=s.sample_id, group_id=s.group_id, prompt_id=s.prompt_id,
                tokens=np.concatenate([s.prompt_tokens, c.response]),
                logprobs=np.concatenate([np.zeros(p, np.float32), c.logprobs]),
                versions=np.concatenate([np.full(p, NOT_GENERATED, np.int32), c.versions]),
                prompt_len=p, finish_reason="abort", owner=self.owner,
                meta={"handoff": {"turn_start": s.turn_start, "turns": ep.turns, "tool_calls": ep.tool_calls,
                                  "parts": [[text, gen] for text, gen in ep.parts]}}))
        self._live.clear()
        self._cancelled.clear()
        return out

    def resume_partial(self, partial: Trajectory, split: str = "train") -> None:
        """Continue a sample another worker handed off (:meth:`hand_off`) under this engine's weights."""
        prompt = self.task.prompt(partial.prompt_id, split)
        p = partial.prompt_len
        state = partial.meta["handoff"]
        episode = self.task.start(prompt)
        episode.turns, episode.tool_calls = state["turns"], state["tool_calls"]
        episode.parts = [(text, bool(gen)) for text, gen in state["parts"]]
        tokens = np.asarray(partial.tokens[:p], dtype=np.int32)
        self._live[partial.sample_id] = _Sample(partial.sample_id, partial.group_id, partial.prompt_id, prompt,
                                                tokens, episode, turn_start=state["turn_start"],
                                                handed_from=partial.owner)
        self.engine.add(Request(partial.sample_id, tokens, self.sampling, partial.tokens[p:],
                                partial.logprobs[p:], partial.versions[p:]))

    def abandon(self) -> list[int]:
        """End of run: drop everything in flight; returns their ids."""
        self.engine.abort_all()
        ids = sorted(self._live)
        self._live.clear()
        self._held.clear()
        self._cancelled.clear()
        return ids

    # -- internals -----------------------------------------------------------------------------

    def _drop(self, sample_id: int) -> None:
        self._live.pop(sample_id, None)
        self._cancelled.discard(sample_id)

    def _on_turn_end(self, c: Completion) -> Trajectory | None:
        s = self._live.get(c.request_id)
        if s is None:
            return None
        if c.request_id in self._cancelled:
            self._drop(c.request_id)
            return None
        self.turns_completed += 1
        turn_tokens = c.response[s.turn_start:]
        turn_text = self.tokenizer.decode(turn_tokens.tolist(), skip_special_tokens=True)
        obs = s.episode.step(turn_text)
        room = self.sampling.max_new_tokens - len(c.response)
        if not obs.done and c.finish_reason == "stop" and room > 0:
            obs_tokens = np.asarray(self.tokenizer.encode(obs.text, add_special_tokens=False), dtype=np.int32)
            obs_tokens = obs_tokens[:room]
            response = np.concatenate([c.response, obs_tokens])
            logprobs = np.concatenate([c.logprobs, np.zeros(len(obs_tokens), np.float32)])
            versions = np.concatenate([c.versions, np.full(len(obs_tokens), NOT_GENERATED, np.int32)])
            if len(response) < self.sampling.max_new_tokens:
                s.turn_start = len(response)
                self.engine.add(Request(c.request_id, s.prompt_tokens, self.sampling, response, logprobs, versions))
                return None
            c = Completion(c.request_id, c.prompt, response, logprobs, versions, "length")
        if not s.episode.done:
            s.episode.end("length" if c.finish_reason == "length" or room <= 0 else c.finish_reason)
        del self._live[c.request_id]
        p = len(s.prompt_tokens)
        return Trajectory(
            sample_id=s.sample_id, group_id=s.group_id, prompt_id=s.prompt_id,
            tokens=np.concatenate([s.prompt_tokens, c.response]),
            logprobs=np.concatenate([np.zeros(p, np.float32), c.logprobs]),
            versions=np.concatenate([np.full(p, NOT_GENERATED, np.int32), c.versions]),
            prompt_len=p, reward=float(s.episode.reward()), finish_reason=s.episode.finish_reason,
            owner=self.owner,
            # `version` stands in for the token versions of a sample that generated nothing.
            meta={"turns": s.episode.turns, "answer": s.prompt.answer, "version": int(self.engine.version),
                  **({"handed_from": s.handed_from} if s.handed_from >= 0 else {})},
        )
