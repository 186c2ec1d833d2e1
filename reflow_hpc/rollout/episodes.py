"""Samples through an engine and their task's environment: the rollout side of a worker.

One engine request per model turn. When a turn ends on a tool-call stop token of a multi-turn task,
the environment's observation is appended to the response (version −1, log-prob 0: not generated,
no loss) and the same sample continues as a new request whose prefix is everything so far. A
single-turn sample is one request. Rewards are computed here, on the worker that owns the sample:
the task's reward, plus DAPO's overlong shaping when the runner is given one
(``shaping``: :class:`reflow_hpc.core.shaping.OverlongShaping`; the task's own reward is kept in ``meta["task_reward"]``).

Partial rollout (DESIGN §6): :meth:`EpisodeRunner.interrupt` moves every in-flight request to a
holding queue (``engine.abort_all``); after the weights are loaded :meth:`EpisodeRunner.resume`
re-adds them, and the engine re-prefills prompt + partial response under the new weights, so one
sample may carry tokens of several versions.

Hand-off (a worker leaving rollout): :meth:`EpisodeRunner.hand_off` returns every sample in flight as
a partial trajectory with its episode's state; :meth:`EpisodeRunner.resume_partial` on another
worker continues it the same way, under that worker's weights.

Tool calls and rewards never stall decoding. At the end of a model turn the environment's step (the
tool call) runs on the worker's executor (:mod:`.tool_executor`, ``task.tool_concurrency`` threads), and
so does the reward of a finished sample; the engine keeps decoding the other samples meanwhile. A
waiting sample holds no engine request — it does not count against the engine's concurrency cap —
and continues as a new request with its exact prefix (every token so far, the observation's after
the model's) once the observation is back. The step runs on a copy of the episode, so the runner's
copy is the state before the call until the result is applied on the engine loop's thread. The
observation is rendered there too (tokenisers are not thread-safe), as a tool message capped at
``task.max_obs_tokens`` (:mod:`reflow_hpc.envs.tools`). A call running longer than
``task.turn_timeout_s`` is answered ``error: timed out`` and its late result dropped.

A sample waiting for its tool or reward at a weight sync stays waiting: it has no engine request to
hold, and its next turn is generated under the new weights. At a hand-off (and when a checkpoint saves
the samples in flight, which is a hand-off to the resumed run) a call or reward still pending is
**re-run** by whoever continues the sample: the partial trajectory ends with the model's tool call
and ``meta["handoff"]["pending"]`` says which job to run again (``turn`` or ``reward``); an
observation the sample already received travels with it, as tokens. The late result on the first
worker is dropped. Tools must therefore tolerate running twice (the built-in ones are pure; code runs
in a fresh sandbox each time); nothing else about the sample changes — its model tokens, log-probs and
versions travel exactly.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..envs.task import Episode, Observation, Prompt, Task, prompt_token_ids
from ..envs.tools import ObservationRenderer
from ..trajectory import NOT_GENERATED, Trajectory
from .engine import Completion, Engine, Request, SamplingParams
from .tool_executor import Job, ToolExecutor, ToolStats

# With nothing to decode, one step waits this long at most for a tool or reward to come back, so the
# worker loop still hears its commands.
IDLE_WAIT_S = 0.05


@dataclass
class _Pending:
    """A job a sample waits for: its turn's environment step (``turn``) or its reward (``reward``)."""
    sample_id: int
    kind: str
    completion: Completion            # the sample so far (a reward's: final)
    turn_text: str = ""
    episode: Episode | None = None    # the copy the turn's step runs on
    job: Job | None = None
    version: int = 0                  # a reward's: the engine's version when the sample's generation ended


def _raw(obs: Observation) -> Observation:
    return obs


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
    started_at: float = 0.0   # monotonic time it began on this worker (tool wait fraction)
    pending: _Pending | None = None   # the tool call or reward it waits for (no engine request meanwhile)


class EpisodeRunner:
    def __init__(self, engine: Engine, task: Task, tokenizer: Any, sampling: SamplingParams, *, owner: int,
                 chat_template: bool = False, shaping: Callable[[int], float] | None = None,
                 tool_concurrency: int | None = None, max_obs_tokens: int | None = None,
                 turn_timeout_s: float | None = None):
        self.engine, self.task, self.tokenizer = engine, task, tokenizer
        t = task.cfg.task           # the [task] keys: tool_concurrency, max_obs_tokens, turn_timeout_s, max_turns
        self.executor = ToolExecutor(tool_concurrency or t.tool_concurrency)
        self.renderer = ObservationRenderer(tokenizer, chat_template=chat_template,
                                            max_obs_tokens=max_obs_tokens or t.max_obs_tokens)
        self.turn_timeout_s = turn_timeout_s or t.turn_timeout_s
        self.max_turns = t.max_turns
        self.tool_stats = ToolStats()
        self.shaping = shaping          # None: the reward is the task's (evaluation, or shaping off)
        self.owner = owner
        self.chat_template = chat_template
        self.stop_ids = tuple(task.stop_token_ids(tokenizer))
        self.turn_end_ids = frozenset(self.stop_ids) - {tokenizer.eos_token_id}
        self.sampling = SamplingParams(sampling.temperature, sampling.top_p, sampling.max_new_tokens,
                                       tuple(dict.fromkeys(sampling.stop_ids + self.stop_ids)), sampling.seed)
        self._live: dict[int, _Sample] = {}
        self._held: list[Completion] = []
        self.turns_completed = 0
        self.failed: list[tuple[int, str]] = []   # (sample id, error) of samples whose environment failed

    # -- inbound -------------------------------------------------------------------------------

    def add(self, sample_id: int, group_id: int, prompt_id: int, split: str = "train",
            prompt: Prompt | None = None) -> None:
        """Start sample ``sample_id`` on the task's prompt ``prompt_id`` of ``split`` (or on ``prompt``)."""
        prompt = prompt if prompt is not None else self.task.prompt(prompt_id, split)
        tokens = np.asarray(prompt_token_ids(self.tokenizer, prompt, self.chat_template), dtype=np.int32)
        self._live[sample_id] = _Sample(sample_id, group_id, prompt_id, prompt, tokens, self.task.start(prompt),
                                        started_at=time.monotonic())
        self.engine.add(Request(sample_id, tokens, self.sampling))

    def cancel(self, sample_ids: Any) -> None:
        """These samples ended at the coordinator: their engine requests end now, unreported, and a tool call
        or reward still running for one of them is dropped when it returns."""
        gone = [sid for sid in sample_ids if sid in self._live]
        running = [sid for sid in gone if self._live[sid].pending is None]
        if running:
            self.engine.abort(running)
        for sid in gone:
            self._drop(sid)

    # -- work ------------------------------------------------------------------------------------

    def has_work(self) -> bool:
        """Requests in the engine, or samples waiting for a tool call or a reward."""
        return self.engine.has_unfinished() or self.waiting() > 0

    def waiting(self) -> int:
        """Samples waiting for a tool call or a reward (outside the engine). Safe from another thread (the
        heartbeat's): the copy of the values is taken under the GIL in one call."""
        return sum(1 for s in list(self._live.values()) if s.pending is not None)

    def close(self) -> None:
        """End the executor's threads (a stuck tool's stays, as a daemon)."""
        self.executor.close()

    @property
    def in_flight(self) -> int:
        return len(self._live)

    def step(self) -> list[Trajectory]:
        """Apply the tool results and rewards that came back, then one engine step (which submits the
        turns that ended to the executor); returns the samples whose episode ended (reward computed).
        With nothing to decode it waits up to IDLE_WAIT_S for the executor instead."""
        done: list[Trajectory] = []
        jobs = self.executor.finished()
        if not jobs and not self.engine.has_unfinished() and self.waiting():
            jobs = self.executor.finished(self._idle_wait_s())
        for job in jobs:
            self._guarded(job.ticket.sample_id, self._on_job, job, done)
        self._check_timeouts(done)
        if self.engine.has_unfinished():
            for c in self.engine.step():
                self._guarded(c.request_id, self._on_turn_end, c, done)
        return done

    def _guarded(self, sample_id: int, fn: Any, arg: Any, done: list[Trajectory]) -> None:
        try:
            traj = fn(arg)
        except Exception as e:       # a broken reward or tool ends this sample, not the worker
            self._drop(sample_id)
            self.failed.append((sample_id, f"{type(e).__name__}: {e}"))
            return
        if traj is not None:
            done.append(traj)

    def interrupt(self) -> int:
        """Hold every in-flight request (before a weight load); returns how many."""
        self._held = self.engine.abort_all()
        return len(self._held)

    def resume(self) -> None:
        """Continue held requests under the weights the engine holds now."""
        held, self._held = self._held, []
        for c in held:
            if c.request_id in self._live:
                self.engine.add(c.as_request(self.sampling))

    def hand_off(self) -> list[Trajectory]:
        """Stop generating and return every sample in flight as a partial trajectory: prompt and response
        so far with their log-probs and per-token versions, the episode's state in ``meta["handoff"]``.
        Another worker continues it with :meth:`resume_partial`. The runner is empty afterwards."""
        held, self._held = self._held + self.engine.abort_all(), []
        out = []
        waiting = [(s.pending.completion, s.pending.kind) for s in self._live.values() if s.pending is not None]
        for c, pending in [(c, None) for c in held] + waiting:
            s = self._live.pop(c.request_id, None)
            if s is None:
                continue                     # ended at the coordinator meanwhile: nothing to hand over
            p = len(s.prompt_tokens)
            ep = s.episode                   # a pending turn's: the state before its call (the copy is dropped)
            state = {"turn_start": s.turn_start, "turns": ep.turns, "tool_calls": ep.tool_calls,
                     "parts": [[text, gen] for text, gen in ep.parts]}
            if pending is not None:          # the receiver re-runs the call or the reward (module docstring)
                state.update(pending=pending, finish_reason=ep.finish_reason, turn_end=c.finish_reason)
            out.append(Trajectory(
                sample_id=s.sample_id, group_id=s.group_id, prompt_id=s.prompt_id,
                tokens=np.concatenate([s.prompt_tokens, c.response]),
                logprobs=np.concatenate([np.zeros(p, np.float32), c.logprobs]),
                versions=np.concatenate([np.full(p, NOT_GENERATED, np.int32), c.versions]),
                prompt_len=p, finish_reason="abort", owner=self.owner, meta={"handoff": state}))
        self._live.clear()
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
        s = _Sample(partial.sample_id, partial.group_id, partial.prompt_id, prompt, tokens, episode,
                    turn_start=state["turn_start"], handed_from=partial.owner, started_at=time.monotonic())
        self._live[partial.sample_id] = s
        pending = state.get("pending")
        if pending is None:
            self.engine.add(Request(partial.sample_id, tokens, self.sampling, partial.tokens[p:],
                                    partial.logprobs[p:], partial.versions[p:]))
            return
        # Handed over while its tool call or reward ran: run that job again here.
        c = Completion(partial.sample_id, tokens, np.asarray(partial.tokens[p:], np.int32),
                       np.asarray(partial.logprobs[p:], np.float32), np.asarray(partial.versions[p:], np.int32),
                       state["turn_end"])
        if pending == "turn":
            self._submit_turn(s, c, self._turn_text(s, c))
        else:
            episode.finish_reason = state["finish_reason"]
            self._submit_reward(s, c)

    def abandon(self) -> list[int]:
        """End of run: drop everything in flight; returns their ids."""
        self.engine.abort_all()
        ids = sorted(self._live)
        self._live.clear()
        self._held.clear()
        return ids

    # -- internals -----------------------------------------------------------------------------

    def _drop(self, sample_id: int) -> None:
        self._live.pop(sample_id, None)

    def _on_turn_end(self, c: Completion) -> Trajectory | None:
        s = self._live.get(c.request_id)
        if s is None:
            return None
        self.turns_completed += 1
        self._submit_turn(s, c, self._turn_text(s, c))
        return None

    def _turn_text(self, s: _Sample, c: Completion) -> str:
        return self.tokenizer.decode(c.response[s.turn_start:].tolist(), skip_special_tokens=True)

    def _submit_turn(self, s: _Sample, c: Completion, turn_text: str) -> None:
        """The environment's reaction to a model turn: inline for a single-turn task (its step only ends the
        episode), on the executor for a multi-turn one."""
        if not self.task.multi_turn:
            self._after_turn(s, c, s.episode.step(turn_text))
            return
        ep = copy.copy(s.episode)
        ep.parts = list(s.episode.parts)
        s.pending = _Pending(s.sample_id, "turn", c, turn_text, ep)
        # The output stays raw on the thread (render = identity); it is rendered on this thread (_on_job).
        s.pending.job = self.executor.submit(s.pending, lambda: ep.step(turn_text, _raw))

    def _submit_reward(self, s: _Sample, c: Completion) -> None:
        ep = s.episode
        s.pending = _Pending(s.sample_id, "reward", c, version=int(self.engine.version))
        s.pending.job = self.executor.submit(s.pending, lambda: float(ep.reward()))

    def _on_job(self, job: Job) -> Trajectory | None:
        """A tool call or a reward came back (on the engine loop's thread)."""
        p: _Pending = job.ticket
        s = self._live.get(p.sample_id)
        if s is None or s.pending is not p:
            return None                      # timed out, cancelled or handed over meanwhile: dropped
        s.pending = None
        if job.error is not None:
            raise job.error
        if p.kind == "reward":
            return self._finished(s, p.completion, job.result, p.version)
        s.episode = p.episode
        obs: Observation = job.result
        if obs.tool and not obs.done:
            st = self.tool_stats
            st.calls += 1
            st.errors += bool(obs.error)
            st.tool_seconds.append(job.ended_at - job.started_at)
            st.wait_s += time.monotonic() - job.submitted_at
            obs = self._render_into(s.episode, obs)
        self._after_turn(s, p.completion, obs)
        return None

    def _render_into(self, ep: Episode, obs: Observation) -> Observation:
        """Render a raw tool output and put the rendered text in the episode's response in its place."""
        raw = obs.text
        obs = self.renderer.render(obs)
        if raw:
            ep.parts[-1] = (obs.text, False)
        else:
            ep.parts.append((obs.text, False))
        return obs

    def _idle_wait_s(self) -> float:
        """Until the nearest tool time limit, at most IDLE_WAIT_S."""
        now, wait = time.monotonic(), IDLE_WAIT_S
        for s in self._live.values():
            job = s.pending.job if s.pending is not None and s.pending.kind == "turn" else None
            if job is not None and job.started_at is not None:
                wait = min(wait, job.started_at + self.turn_timeout_s - now)
        return max(wait, 0.001)

    def _check_timeouts(self, done: list[Trajectory]) -> None:
        """Tool calls running past ``task.turn_timeout_s``: the sample goes on with an error observation
        (or ends, when that was its last allowed turn, ``task.max_turns``)."""
        now = time.monotonic()
        late = [s for s in self._live.values() if s.pending is not None and s.pending.kind == "turn"
                and s.pending.job.started_at is not None and now - s.pending.job.started_at > self.turn_timeout_s]
        for s in late:
            p, ep = s.pending, s.episode         # the runner's episode: the thread steps a copy
            s.pending = None
            ep.turns += 1
            ep.parts.append((p.turn_text, True))
            self.tool_stats.timeouts += 1
            if ep.turns >= self.max_turns:       # a turn the environment takes this long over is a tool call
                ep.end("turns")
                obs = Observation(done=True, finish_reason="turns")
            else:
                ep.tool_calls += 1
                self.tool_stats.calls += 1
                self.tool_stats.tool_seconds.append(now - p.job.started_at)
                self.tool_stats.wait_s += now - p.job.submitted_at
                obs = self._render_into(ep, Observation(f"error: timed out after {self.turn_timeout_s:g} s",
                                                        done=False, tool="?", error="timeout"))
            self._guarded(s.sample_id, lambda _: self._after_turn(s, p.completion, obs), None, done)

    def _after_turn(self, s: _Sample, c: Completion, obs: Observation) -> None:
        """Continue the sample with the observation as a new request, or end it and score it."""
        room = self.sampling.max_new_tokens - len(c.response)
        if not obs.done and c.finish_reason == "stop" and room > 0:
            ids = obs.token_ids if obs.token_ids is not None else self.renderer.encode(obs.text)
            obs_tokens = np.asarray(ids, dtype=np.int32)[:room]
            response = np.concatenate([c.response, obs_tokens])
            logprobs = np.concatenate([c.logprobs, np.zeros(len(obs_tokens), np.float32)])
            versions = np.concatenate([c.versions, np.full(len(obs_tokens), NOT_GENERATED, np.int32)])
            if len(response) < self.sampling.max_new_tokens:
                s.turn_start = len(response)
                self.engine.add(Request(c.request_id, s.prompt_tokens, self.sampling, response, logprobs, versions))
                return
            c = Completion(c.request_id, c.prompt, response, logprobs, versions, "length")
        if not s.episode.done:
            s.episode.end("length" if c.finish_reason == "length" or room <= 0 else c.finish_reason)
        self._submit_reward(s, c)

    def _finished(self, s: _Sample, c: Completion, reward: float, version: int) -> Trajectory:
        """The trajectory of a scored sample; ``version``: the engine's when its generation ended."""
        del self._live[c.request_id]
        st = self.tool_stats
        st.samples += 1
        st.turns += s.episode.turns
        st.sample_s += time.monotonic() - s.started_at
        p = len(s.prompt_tokens)
        reward = float(reward)
        meta = {"turns": s.episode.turns, "tool_calls": s.episode.tool_calls, "answer": s.prompt.answer,
                "version": version,
                **({"handed_from": s.handed_from} if s.handed_from >= 0 else {})}
        if self.shaping is not None:
            meta["task_reward"] = reward
            reward += self.shaping(int(np.count_nonzero(c.versions != NOT_GENERATED)))
        return Trajectory(
            sample_id=s.sample_id, group_id=s.group_id, prompt_id=s.prompt_id,
            tokens=np.concatenate([s.prompt_tokens, c.response]),
            logprobs=np.concatenate([np.zeros(p, np.float32), c.logprobs]),
            versions=np.concatenate([np.full(p, NOT_GENERATED, np.int32), c.versions]),
            prompt_len=p, reward=reward, finish_reason=s.episode.finish_reason,
            owner=self.owner,
            # `version` stands in for the token versions of a sample that generated nothing.
            meta=meta,
        )
