"""The embedded ``torch`` rollout engine: continuous batching over a slot KV cache (DESIGN §6).

It runs a ``transformers`` ``Qwen3ForCausalLM`` on CPU or CUDA with the same code, behind the
:class:`~reflow_hpc.rollout.engine.Engine` interface, and is the reference the vLLM engine is
checked against. Rules it implements:

- **Slots.** ``max_concurrency`` slots, each able to hold ``max_model_len`` tokens of KV (0 = the
  model's ``max_position_embeddings`` capped at the budget), allocated once: memory is
  ``max_concurrency × max_model_len`` tokens of KV, of which ``kv_budget_tokens`` may be in use (the
  role a paged allocator's capacity plays in vLLM). A running request owns one slot; running
  requests always occupy rows ``0..n-1``.
- **A step.** ``step()`` (1) admits queued requests in FIFO order into free slots while their
  context fits the budget (and the prefill tokens of this step stay within ``max_prefill_tokens``;
  the first one is always allowed), (2) prefills every admitted request's context except its last
  token in one padded batch, (3) runs one batched decode step over all running requests at their
  own positions and samples one token each, (4) preempts while the running requests would need
  more KV than the budget in the next decode, (5) returns the requests that finished. A request
  added while others run is admitted at the next step: nobody waits for a batch to drain.
- **KV budget.** A running request with context length ``c`` (prompt + response so far) needs
  ``c`` KV tokens in the coming decode step; the sum over running requests never exceeds
  ``kv_budget_tokens``. Admission needs room for the whole context. When the running requests
  outgrow the budget, the most recently admitted ones are preempted by recompute (as in vLLM): the
  slot is freed and the request goes back to the head of the queue with its generated tokens,
  log-probs and versions; when re-admitted, prompt + generated tokens are prefilled again.
  ``max_model_len ≤ kv_budget_tokens`` so one request always fits and progress is guaranteed.
- **Sampling.** Temperature, top-p, stop ids (the stop token is emitted and kept) and
  ``max_new_tokens``, which counts the whole response including a continued prefix; a request
  also ends when its context reaches ``max_model_len``. Each token carries its behaviour log-prob,
  ``log_softmax(logits / temperature)`` at the sampled token before top-p truncation (see
  :mod:`reflow_hpc.rollout.sampling`), and the engine's ``version`` when it was sampled.
- **Seeds.** A request's random stream is keyed by ``(engine seed, request_id)``, or by
  ``SamplingParams.seed`` alone when the request carries one (vLLM's semantics). Each token's draw
  depends only on that key and the token's position, so results do not depend on batch
  companions, preemption or step timing. Give every worker the run's seed and every sample a
  unique id, and a sample's tokens do not depend on which worker generated it.
- **Partial rollouts.** ``abort_all()`` returns every unfinished request as a ``Completion`` with
  finish reason ``abort`` (requests that had already ended but were not yet returned keep their
  reason) and leaves the engine empty. Re-adding one with ``Completion.as_request`` prefills
  prompt + partial response under the weights loaded since, and later tokens carry the new
  version. ``load_weights`` while requests run moves them back to the head of the queue (not
  counted as preemptions), so they too continue by re-prefill under the new weights: every token
  is exactly what the weights of its version produce after the context it saw. With
  ``sync_kv="keep"`` (an in-flight weight update) they stay in their slots instead and go on
  decoding under the new weights over the KV that earlier weights computed; each token's log-prob
  is still the one it was sampled with, so the trainer's importance ratio accounts for it.
- **Sleep.** ``sleep()`` moves running requests back to the queue (keeping their tokens), frees
  the KV cache and, on CUDA, moves the weights to CPU memory; ``wake()`` undoes it.
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Mapping

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from .engine import (Completion, EngineStats, LimitError, Request, SamplingParams, check_limits, checked_request,
                     enqueue)
from .kv_cache import SlotKVCache, kv_bytes_per_token
from .qwen3_forward import Qwen3Weights, RopeTable, check_supported, decode, prefill
from .sampling import sample, stream_key, uniforms


@dataclass
class _Sequence:
    """One request inside the engine. Its context arrays live here while it is queued and in the
    slot buffers while it runs (then ``row`` ≥ 0 and the arrays are None)."""
    request_id: int
    sampling: SamplingParams
    prompt_len: int
    limit: int                       # context length at which the request ends with "length"
    key: int                         # random stream key
    tokens: np.ndarray | None        # int32 [c]: prompt + response so far
    logprobs: np.ndarray | None      # float32 [c], aligned with tokens (0 on the prompt)
    versions: np.ndarray | None      # int32 [c], aligned with tokens (-1 on the prompt)
    row: int = -1
    admitted: int = -1               # admission counter: larger = admitted more recently


def _continues(seq: _Sequence) -> bool:
    return len(seq.tokens) > seq.prompt_len


class TorchEngine:
    """Continuous-batching engine over a ``Qwen3ForCausalLM`` (see the module docstring).

    The engine takes the model over: it reads the weights in place, ``load_weights`` writes into
    them and ``sleep``/``wake`` move them. Use one model object per engine.
    """

    def __init__(self, model, *, max_concurrency: int = 32, kv_budget_tokens: int = 16384,
                 max_model_len: int = 0, max_prefill_tokens: int = 4096, seed: int = 0, version: int = 0,
                 sync_kv: str = "recompute"):
        check_supported(model.config)
        if sync_kv not in ("recompute", "keep"):
            raise ValueError(f"rollout.sync_kv = {sync_kv!r}: must be recompute or keep")
        max_model_len = check_limits(max_concurrency=max_concurrency, kv_budget_tokens=kv_budget_tokens,
                                     max_model_len=max_model_len, max_prefill_tokens=max_prefill_tokens,
                                     max_positions=model.config.max_position_embeddings)
        self.model = model.eval()
        self.version = int(version)
        self.seed = int(seed)
        self.sync_kv = sync_kv
        self.max_concurrency = max_concurrency
        self.concurrency_cap = max_concurrency      # what may run at once: the scheduler lowers it under KV pressure
        self.kv_budget_tokens = kv_budget_tokens
        self.max_model_len = max_model_len
        self.max_prefill_tokens = max_prefill_tokens
        self.vocab_size = model.config.vocab_size

        self._weights = Qwen3Weights.of(model)
        self.device, dtype = self._weights.device, self._weights.dtype
        self._rope = RopeTable.of(model, max_model_len, self.device, dtype)
        self._check_cache_fits(max_concurrency, max_model_len, dtype)
        self._cache = SlotKVCache(layers=len(self._weights.layers), slots=max_concurrency,
                                  kv_heads=self._weights.num_kv_heads, max_model_len=max_model_len,
                                  head_dim=self._weights.head_dim, dtype=dtype, device=self.device)
        self._asleep = False

        # Slot buffers: the context of every running request, aligned by position.
        s, m, dev = max_concurrency, max_model_len, self.device
        self._tokens = torch.zeros(s, m, dtype=torch.int64, device=dev)
        self._logprobs = torch.zeros(s, m, dtype=torch.float32, device=dev)
        self._versions = torch.full((s, m), -1, dtype=torch.int32, device=dev)
        # Per-row state. Lengths are mirrored on the host: they change deterministically (+1 per
        # decode), so budget checks and attention lengths never wait for the device.
        self._length = np.zeros(s, dtype=np.int64)
        self._length_dev = torch.zeros(s, dtype=torch.int64, device=dev)
        self._limit_dev = torch.zeros(s, dtype=torch.int64, device=dev)
        self._temperature = torch.ones(s, dtype=torch.float32, device=dev)
        self._top_p = torch.ones(s, dtype=torch.float32, device=dev)
        self._key = torch.zeros(s, dtype=torch.int64, device=dev)
        self._stop = torch.full((s, 0), -1, dtype=torch.int64, device=dev)
        self._rows = torch.arange(s, device=dev)
        self._row_state = ("_tokens", "_logprobs", "_versions", "_length_dev", "_limit_dev",
                           "_temperature", "_top_p", "_key", "_stop")

        self._running: list[_Sequence] = []          # index = row
        self._queue: deque[_Sequence] = deque()
        self._ready: list[Completion] = []           # ended without running (prefix already at its limit)
        self._ids: set[int] = set()
        self._admissions = 0
        self._preemptions = 0
        self._generated = 0
        self._prefilled = 0       # tokens prefilled, re-prefills included: what aborts and preemptions cost
        self._decode_steps = 0

    def _check_cache_fits(self, slots: int, max_model_len: int, dtype: torch.dtype) -> None:
        """On CUDA, a slot cache larger than the device's free memory is a LimitError naming the keys, not an
        out-of-memory error deep in the first allocation (every slot holds max_model_len positions)."""
        if self.device.type != "cuda":
            return
        per_token = kv_bytes_per_token(self.model.config, dtype)
        need = slots * max_model_len * per_token
        free, _ = torch.cuda.mem_get_info(self.device)
        if need > free:
            raise LimitError("rollout.max_model_len", max_model_len,
                             f"the slot KV cache holds max_concurrency ({slots}) × max_model_len positions of "
                             f"{per_token} B = {need / 2**30:.1f} GiB, more than the {free / 2**30:.1f} GiB free "
                             f"on {self.device}: lower rollout.max_model_len (0 = the KV budget) or "
                             f"rollout.max_concurrency")

    @classmethod
    def from_config(cls, model, cfg, *, device: str | torch.device = "cpu", seed: int = 0,
                    version: int = 0) -> "TorchEngine":
        """Build from the ``[rollout]`` config section; moves ``model`` to ``device``."""
        return cls(model.to(device), max_concurrency=cfg.max_concurrency, kv_budget_tokens=cfg.kv_budget_tokens,
                   max_model_len=cfg.max_model_len, max_prefill_tokens=cfg.max_prefill_tokens,
                   seed=seed, version=version, sync_kv=cfg.sync_kv)

    # ----------------------------------------------------------------------------------------
    # Interface
    # ----------------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue one request (a sample, possibly the continuation of a partial one)."""
        seq = self._sequence(request)
        self._ids.add(seq.request_id)
        if len(seq.tokens) >= seq.limit:
            self._ready.append(self._completion_of(seq, seq.tokens, seq.logprobs, seq.versions, "length"))
            return
        enqueue(self._queue, seq, _continues)

    @torch.inference_mode()
    def step(self) -> list[Completion]:
        """Admit, prefill, decode one token for every running request, preempt; return the finished."""
        if self._asleep:
            raise RuntimeError("torch engine: step() while asleep; call wake() first")
        done, self._ready = self._ready, []
        with self._attention():
            admitted = self._admit()
            if admitted:
                self._prefill(admitted)
            if self._running:
                done += self._decode()
        self._preempt_over_budget()   # so that the next decode fits: the budget holds between steps
        for c in done:
            self._ids.discard(c.request_id)
        return done

    def _attention(self):
        """The attention kernels of a step. On CUDA cuDNN's is left out: with a mask it builds an execution plan
        for every new key length, that is at every decode step (measured on an H200, Qwen3-0.6B, 64 requests:
        1.7 ms of CPU per layer call, 60 % of a 64 ms step whose kernels took 5 ms)."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])

    def abort_all(self) -> list[Completion]:
        """Every unfinished request as a partial Completion (finish reason "abort"); engine empty."""
        out = self._ready
        for row in range(len(self._running) - 1, -1, -1):
            out.append(self._completion_of_row(row, "abort"))
            self._free(row)
        for seq in self._queue:
            out.append(self._completion_of(seq, seq.tokens, seq.logprobs, seq.versions, "abort"))
        self._ready, self._queue = [], deque()
        self._ids.clear()
        return out

    def abort(self, request_ids: Iterable[int]) -> None:
        """End these requests wherever they are (running, queued, or ended but not yet returned) without
        returning them; ids not in the engine are ignored. The others run on undisturbed."""
        ids = set(request_ids) & self._ids
        if not ids:
            return
        for row in range(len(self._running) - 1, -1, -1):
            if self._running[row].request_id in ids:
                self._free(row)
        self._queue = deque(s for s in self._queue if s.request_id not in ids)
        self._ready = [c for c in self._ready if c.request_id not in ids]
        self._ids -= ids

    def load_weights(self, state: Mapping[str, object] | Iterable[tuple[str, object]], version: int) -> None:
        """Copy tensors into the model in place (HF ``state_dict`` names; any subset, any bucket
        order) and set the version of tokens sampled from now on. Running requests re-prefill under
        them, or with ``sync_kv="keep"`` keep their KV and decode on."""
        if self.sync_kv == "recompute":
            self._requeue_running()
        targets = dict(self.model.named_parameters(remove_duplicate=False))
        targets.update(self.model.named_buffers(remove_duplicate=False))
        items = state.items() if isinstance(state, Mapping) else state
        with torch.no_grad():
            for name, value in items:
                target = targets.get(name)
                if target is None:
                    raise ValueError(f"load_weights: unknown tensor {name!r} (not a parameter of the "
                                     f"{type(self.model).__name__})")
                value = torch.as_tensor(value)
                if tuple(value.shape) != tuple(target.shape):
                    raise ValueError(f"load_weights: {name} has shape {tuple(value.shape)}, "
                                     f"the model's is {tuple(target.shape)}")
                target.copy_(value)
        self.version = int(version)

    def sleep(self) -> None:
        """Free the KV cache and (on CUDA) move the weights to CPU; unfinished requests stay queued."""
        if self._asleep:
            return
        self._requeue_running()
        self._cache.release()
        if self.device.type != "cpu":
            self.model.to("cpu")
            self._weights = Qwen3Weights.of(self.model)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        self._asleep = True

    def wake(self) -> None:
        """Undo :meth:`sleep`: weights back on the device, KV cache allocated again."""
        if not self._asleep:
            return
        if self.device.type != "cpu":
            self.model.to(self.device)
            self._weights = Qwen3Weights.of(self.model)
        self._cache.allocate()
        self._asleep = False

    def set_concurrency_cap(self, cap: int) -> None:
        """Run at most ``cap`` requests at once (1 to ``max_concurrency``, the slots); running requests above
        a lowered cap finish, none is preempted for it."""
        self.concurrency_cap = max(1, min(int(cap), self.max_concurrency))

    def stats(self) -> EngineStats:
        n = len(self._running)
        return EngineStats(running=n, queued=len(self._queue), kv_tokens_used=int(self._length[:n].sum()),
                           kv_tokens_budget=self.kv_budget_tokens, preemptions=self._preemptions,
                           generated_tokens=self._generated, prefilled_tokens=self._prefilled,
                           decode_steps=self._decode_steps, version=self.version)

    def has_unfinished(self) -> bool:
        return bool(self._running or self._queue or self._ready)

    def running_ids(self) -> list[int]:
        """Request ids holding a slot now; each has sampled at least one token (for latency probes)."""
        return [s.request_id for s in self._running]

    # ----------------------------------------------------------------------------------------
    # Requests in and out
    # ----------------------------------------------------------------------------------------

    def _sequence(self, request: Request) -> _Sequence:
        rid, sp = int(request.request_id), request.sampling
        if rid in self._ids:
            raise ValueError(f"request {rid}: a request with this id is already in the engine")
        if not 0 < sp.top_p <= 1:
            raise ValueError(f"request {rid}: top_p = {sp.top_p}: must be in (0, 1]")
        req = checked_request(request, vocab_size=self.vocab_size, max_model_len=self.max_model_len)
        p = len(req.prompt)
        key = stream_key(self.seed, rid) if sp.seed is None else stream_key(sp.seed)
        return _Sequence(
            request_id=rid, sampling=sp, prompt_len=p, limit=min(p + sp.max_new_tokens, self.max_model_len),
            key=key, tokens=np.concatenate([req.prompt, req.response_prefix]),
            logprobs=np.concatenate([np.zeros(p, np.float32), req.prefix_logprobs]),
            versions=np.concatenate([np.full(p, -1, np.int32), req.prefix_versions]))

    @staticmethod
    def _completion_of(seq: _Sequence, tokens, logprobs, versions, reason: str) -> Completion:
        p = seq.prompt_len
        return Completion(request_id=seq.request_id, prompt=np.asarray(tokens[:p], dtype=np.int32),
                          response=np.asarray(tokens[p:], dtype=np.int32),
                          logprobs=np.asarray(logprobs[p:], dtype=np.float32),
                          versions=np.asarray(versions[p:], dtype=np.int32), finish_reason=reason)

    def _row_context(self, row: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        c = int(self._length[row])
        # copy=True: on CPU `.cpu()` would return a view of the slot buffers, which later steps overwrite
        return (self._tokens[row, :c].to("cpu", torch.int32, copy=True).numpy(),
                self._logprobs[row, :c].to("cpu", copy=True).numpy(),
                self._versions[row, :c].to("cpu", copy=True).numpy())

    def _completion_of_row(self, row: int, reason: str) -> Completion:
        return self._completion_of(self._running[row], *self._row_context(row), reason)

    # ----------------------------------------------------------------------------------------
    # Scheduling
    # ----------------------------------------------------------------------------------------

    def _kv_needed(self) -> int:
        return int(self._length[:len(self._running)].sum())

    def _preempt_over_budget(self) -> None:
        while len(self._running) > 1 and self._kv_needed() > self.kv_budget_tokens:
            victim = max(self._running, key=lambda s: s.admitted)
            # appendleft in reverse admission order keeps the earliest-admitted victim at the head
            self._queue.appendleft(self._evict(victim.row))
            self._preemptions += 1

    def _requeue_running(self) -> None:
        """Every running request back to the head of the queue, in admission order (re-prefilled later)."""
        evicted = [self._evict(row) for row in range(len(self._running) - 1, -1, -1)]
        self._queue.extendleft(sorted(evicted, key=lambda s: s.admitted, reverse=True))

    def _evict(self, row: int) -> _Sequence:
        """Take a running request off its slot, keeping its context on the host."""
        seq = self._running[row]
        seq.tokens, seq.logprobs, seq.versions = self._row_context(row)
        self._free(row)
        return seq

    def _free(self, row: int) -> None:
        """Release a row; the last running row moves into it so rows stay 0..n-1."""
        last = len(self._running) - 1
        self._running[row].row = -1
        if row != last:
            for name in self._row_state:
                buf = getattr(self, name)
                buf[row] = buf[last]
            self._cache.move_row(last, row, int(self._length[last]))
            self._length[row] = self._length[last]
            moved = self._running[last]
            moved.row = row
            self._running[row] = moved
        self._running.pop()

    def _admit(self) -> list[_Sequence]:
        used, prefill_tokens, admitted = self._kv_needed(), 0, []
        while self._queue and len(self._running) < self.concurrency_cap:
            seq = self._queue[0]
            c = len(seq.tokens)
            if used + c > self.kv_budget_tokens:
                break
            if admitted and prefill_tokens + c - 1 > self.max_prefill_tokens:
                break
            self._queue.popleft()
            seq.row, seq.admitted = len(self._running), self._admissions
            self._admissions += 1
            self._running.append(seq)
            admitted.append(seq)
            used += c
            prefill_tokens += c - 1
        if admitted:
            self._upload(admitted)
        return admitted

    def _upload(self, admitted: list[_Sequence]) -> None:
        """Write the admitted requests' contexts and sampling state into their rows, one copy per buffer."""
        n, width = len(admitted), max(len(s.tokens) for s in admitted)
        tokens = np.zeros((n, width), np.int64)
        logprobs = np.zeros((n, width), np.float32)
        versions = np.full((n, width), -1, np.int32)
        stop_width = max(self._stop.shape[1], max(len(s.sampling.stop_ids) for s in admitted))
        if stop_width > self._stop.shape[1]:
            grown = torch.full((self.max_concurrency, stop_width), -1, dtype=torch.int64, device=self.device)
            grown[:, :self._stop.shape[1]] = self._stop
            self._stop = grown
        stops = np.full((n, stop_width), -1, np.int64)
        for i, s in enumerate(admitted):
            c = len(s.tokens)
            tokens[i, :c], logprobs[i, :c], versions[i, :c] = s.tokens, s.logprobs, s.versions
            stops[i, :len(s.sampling.stop_ids)] = s.sampling.stop_ids
            self._length[s.row] = c
            s.tokens = s.logprobs = s.versions = None
        rows = torch.tensor([s.row for s in admitted], device=self.device)
        dev = self.device
        self._tokens[rows, :width] = torch.from_numpy(tokens).to(dev)
        self._logprobs[rows, :width] = torch.from_numpy(logprobs).to(dev)
        self._versions[rows, :width] = torch.from_numpy(versions).to(dev)
        self._stop[rows] = torch.from_numpy(stops).to(dev)
        self._length_dev[rows] = torch.from_numpy(self._length[[s.row for s in admitted]]).to(dev)
        self._limit_dev[rows] = torch.tensor([s.limit for s in admitted], dtype=torch.int64, device=dev)
        self._temperature[rows] = torch.tensor([s.sampling.temperature for s in admitted],
                                               dtype=torch.float32, device=dev)
        self._top_p[rows] = torch.tensor([s.sampling.top_p for s in admitted], dtype=torch.float32, device=dev)
        self._key[rows] = torch.tensor([s.key for s in admitted], dtype=torch.int64, device=dev)

    def _prefill(self, admitted: list[_Sequence]) -> None:
        """KV of every admitted context except its last token (decode feeds that one)."""
        todo = [s for s in admitted if self._length[s.row] >= 2]
        if not todo:
            return
        lengths_host = self._length[[s.row for s in todo]] - 1
        rows = torch.tensor([s.row for s in todo], device=self.device)
        lengths = torch.from_numpy(lengths_host).to(self.device)
        width = int(lengths_host.max())
        self._prefilled += int(lengths_host.sum())
        prefill(self._weights, self._rope, self._cache.k, self._cache.v,
                self._tokens[rows, :width], lengths, rows)

    def _decode(self) -> list[Completion]:
        b = len(self._running)
        rows = self._rows[:b]
        length = self._length_dev[:b]
        positions = length - 1
        tokens_in = self._tokens[:b].gather(1, positions[:, None])[:, 0]
        logits = decode(self._weights, self._rope, self._cache.k, self._cache.v, tokens_in, positions, rows,
                        int(self._length[:b].max()))
        temperature, top_p = self._temperature[:b], self._top_p[:b]
        token, logprob = sample(logits, temperature, top_p, uniforms(self._key[:b], length),
                                any_top_p=any(s.sampling.top_p < 1 for s in self._running),
                                any_greedy=any(s.sampling.temperature == 0 for s in self._running))
        self._tokens[rows, length] = token
        self._logprobs[rows, length] = logprob
        self._versions[rows, length] = self.version
        length += 1
        self._length[:b] += 1
        self._generated += b
        self._decode_steps += 1

        done = length >= self._limit_dev[:b]
        if self._stop.shape[1]:
            hit_stop = (token[:, None] == self._stop[:b]).any(-1)
            done |= hit_stop
        finished = done.nonzero()[:, 0].tolist()
        out = []
        for row in reversed(finished):   # highest row first: moving the last row never moves a finished one
            seq = self._running[row]
            tokens, logprobs, versions = self._row_context(row)
            reason = "stop" if int(tokens[-1]) in seq.sampling.stop_ids else "length"
            out.append(self._completion_of(seq, tokens, logprobs, versions, reason))
            self._free(row)
        out.reverse()
        return out
