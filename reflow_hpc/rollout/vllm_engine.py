"""The ``vllm`` rollout engine: vLLM's ``LLMEngine`` behind the :class:`~reflow_hpc.rollout.engine.Engine`
interface (DESIGN §6). Checked against the trainer and the torch engine by the shared conformance
tests (``tests/helpers/engine_conformance.py``). Rules it implements:

- **In process.** ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` is forced before vLLM is imported, so the
  engine core and its one worker run in the calling process: nothing forks after MPI init. One
  engine per process (vLLM keeps its parallel groups in globals). Where torch.distributed is
  initialised (a job's workers), vLLM builds its groups over that world with collective calls, so
  every rank builds its engine at the same point (workers do, at setup); vLLM's teardown at exit is
  detached, as it would destroy the job's default group. vLLM's CPU worker replaces
  ``torch.set_num_threads`` with a no-op and seeds torch's global RNG when it starts.
- **Tensor parallel** (``tp`` > 1): an instance is ``tp`` consecutive ranks of the job's world, every
  one building its engine with the same arguments and then making the same calls in the same order
  (vLLM's external-launcher executor: one worker per rank, each with its own scheduler, kept
  identical by determinism; per-request seeds do not depend on the rank). Every rank loads the full
  weights; vLLM keeps its shard of each tensor. In a job the instance's first rank drives the others
  (``rollout/tensor_parallel.py``).
- **Model.** Built from the policy's Hugging Face directory with tokenizer init skipped (requests
  are token ids, ``TokensPrompt``); :meth:`VllmEngine.from_config` then loads the weights of the
  model it is given, so a resumed run generates with its checkpoint's weights, not the directory's.
- **Log-probs.** ``logprobs_mode="processed_logprobs"`` with one log-prob per sampled token:
  ``log_softmax(logits / temperature)`` at the sampled token (``log_softmax(logits)`` when greedy),
  what the trainer recomputes. vLLM takes it *after* top-p truncation, so a request with
  ``top_p < 1`` is refused (the torch engine reports the pre-truncation value).
- **Tokens and versions.** Outputs stream as deltas; each token gets the engine's ``version`` at
  the step that sampled it. A continued request (``response_prefix``) is sent as prompt + prefix,
  its remaining budget is ``max_new_tokens − len(prefix)`` (and what ``max_model_len`` leaves), and
  its prefix keeps its log-probs and versions. Stop ids end a request and are kept as its last
  token; the model's EOS ends nothing unless it is a stop id (``ignore_eos``).
- **Seeds.** Every request gets a vLLM per-request seed derived from (engine seed, request id) or
  from its own ``SamplingParams.seed``, and from the prefix length, so a continuation does not
  replay its first draws. Tokens do not depend on which worker samples them, up to vLLM's
  batch-dependent numerics.
- **Concurrency cap.** The engine keeps its own FIFO queue and lets at most ``cap`` requests into
  vLLM at once (admitted at the start of a step); vLLM's ``max_num_seqs`` is ``max_concurrency``.
- **KV budget.** ``vllm_kv_cache_gb = 0``: vLLM gets ``ceil(kv_budget_tokens / block) + 1`` blocks
  (one is vLLM's null block), so its capacity is the budget rounded up to whole blocks;
  otherwise as many blocks as that memory holds. Preemption (by recompute) is vLLM's.
- **Weight loads.** ``load_weights`` first takes the requests inside vLLM back to the head of the
  queue as continuations (as a preemption by recompute would, uncounted, as in the torch engine),
  then streams (name, tensor) pairs in Hugging Face names through vLLM's in-place reload
  (``reload_weights``: layers are loaded, then re-processed into the kernels' formats), re-packs
  layers that share a tied tensor, and resets the prefix cache: every request re-prefills under the
  new weights and its later tokens carry the new version. Tensors that vLLM fuses into one layer
  (q/k/v, gate/up) must come in the same call; a layer whose tensors are incomplete is left as it
  was and the call then raises. A tied name (``lm_head.weight`` beside tied embeddings) is
  skipped: vLLM shares the embedding's tensor, which the trainer's weight sync sends. With
  ``sync_kv="keep"`` (an in-flight weight update) the requests inside vLLM stay there and decode on
  over the KV that earlier weights computed, and vLLM runs without prefix caching: a cached block
  would otherwise hand KV of earlier weights to requests admitted after the load.
- **Partial rollouts.** ``abort_all`` returns every unfinished request with its tokens, log-probs
  and versions (finish reason "abort"; ones that already ended keep theirs) and aborts them in
  vLLM, leaving the engine empty.
- **Sleep.** Where vLLM has a sleep mode (CUDA), ``sleep`` returns the running requests to the
  head of the queue as continuations and puts vLLM to sleep at level 1 (weights offloaded, KV
  cache discarded); ``wake`` wakes it. On CPU vLLM has none: requests stay and nothing is freed.
  Either way ``step`` refuses to run while asleep.
- **Stats** come from vLLM's own per-step scheduler and iteration stats (a stat logger): running,
  waiting (vLLM's plus this queue), KV tokens used (block-granular) / capacity, cumulative
  preemptions and generated tokens.
"""

from __future__ import annotations

import logging
import math
import os
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import numpy as np

from .engine import Completion, EngineStats, Request, SamplingParams, check_limits, checked_request, enqueue
from .kv_cache import kv_bytes_per_token
from .sampling import stream_key

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"   # before vllm is imported: the engine core stays in process
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402
from vllm import EngineArgs, LLMEngine  # noqa: E402
from vllm import SamplingParams as VllmSamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402
from vllm.sampling_params import RequestOutputKind  # noqa: E402
from vllm.v1.metrics.loggers import StatLoggerBase  # noqa: E402

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_FUSED = ((".q_proj.", ".qkv_proj."), (".k_proj.", ".qkv_proj."), (".v_proj.", ".qkv_proj."),
          (".gate_proj.", ".gate_up_proj."), (".up_proj.", ".gate_up_proj."))


def _layer_of(name: str) -> str:
    """The vLLM layer a Hugging Face tensor loads into (fused projections share one)."""
    for part, fused in _FUSED:
        if part in name:
            return name.replace(part, fused).rsplit(".", 1)[0]
    return name.rsplit(".", 1)[0]


@dataclass
class _Live:
    """A request inside vLLM: what it had when admitted plus what vLLM has streamed since."""
    request_id: int
    prompt: np.ndarray
    sampling: SamplingParams
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]


@dataclass
class _Tally:
    """vLLM's per-step stats, summed (preemptions, generated tokens) or last seen (the rest)."""
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    preemptions: int = 0
    generated: int = 0


def _stat_logger(tally: _Tally) -> type:
    """A vLLM stat-logger class whose instances add each step's stats to ``tally``."""

    class _Logger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            if scheduler_stats is not None:
                tally.running = scheduler_stats.num_running_reqs
                tally.waiting = scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
                tally.kv_usage = scheduler_stats.kv_cache_usage
            if iteration_stats is not None:
                tally.preemptions += iteration_stats.num_preempted_reqs
                tally.generated += iteration_stats.num_generation_tokens

        def log_engine_initialized(self):
            pass

    return _Logger


def _reload(worker: Any, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Runs on vLLM's worker: reload in place, then re-pack layers that share a tied tensor (the
    reload processes a shared tensor for one of its layers only, e.g. the embedding, not lm_head)."""
    # Its per-layer warnings name layers with nothing to load (rotary cache, the tied lm_head re-packed below).
    quiet = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        worker.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
    finally:
        quiet.setLevel(level)
    model = worker.model_runner.get_model()
    holders: dict[int, list] = {}
    for module in model.modules():
        w = getattr(module, "weight", None)
        if isinstance(w, torch.Tensor) and w.numel() and getattr(module, "quant_method", None) is not None:
            holders.setdefault(w.untyped_storage().data_ptr(), []).append(module)
    for modules in holders.values():
        if len(modules) > 1:
            for module in modules:
                module.quant_method.process_weights_after_loading(module)


def _continues(request: Request) -> bool:
    return len(request.response_prefix) > 0


class VllmEngine:
    """vLLM behind the engine interface (see the module docstring)."""

    def __init__(self, model_path: str | os.PathLike, *, max_concurrency: int = 32, kv_budget_tokens: int = 16384,
                 max_model_len: int = 0, max_prefill_tokens: int = 4096, seed: int = 0, version: int = 0,
                 dtype: str = "float32", kv_cache_gb: float = 0.0, gpu_memory_utilization: float = 0.9,
                 enforce_eager: bool = True, device: str = "cpu", tp: int = 1, sync_kv: str = "recompute"):
        from transformers import AutoConfig, AutoModelForCausalLM

        path = Path(model_path)
        if not (path / "config.json").is_file():
            raise ValueError(f"model.path = {str(path)!r}: no Hugging Face model directory (config.json) there")
        hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
        max_model_len = check_limits(max_concurrency=max_concurrency, kv_budget_tokens=kv_budget_tokens,
                                     max_model_len=max_model_len, max_prefill_tokens=max_prefill_tokens,
                                     max_positions=hf_config.max_position_embeddings)
        if dtype not in _DTYPES.values():
            raise ValueError(f"model.dtype = {dtype!r}: must be one of {', '.join(_DTYPES.values())}")
        if sync_kv not in ("recompute", "keep"):
            raise ValueError(f"rollout.sync_kv = {sync_kv!r}: must be recompute or keep")
        self.sync_kv = sync_kv
        self.version = int(version)
        self.seed = int(seed)
        self.max_concurrency = max_concurrency
        self.concurrency_cap = max_concurrency
        self.max_model_len = max_model_len
        self.vocab_size = hf_config.vocab_size
        # Names and shapes of the architecture's tensors, for load_weights' checks (no memory: meta).
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(hf_config)
        self._shapes = {n: tuple(p.shape) for n, p in skeleton.named_parameters(remove_duplicate=False)}
        self._tied = {n for n, p in skeleton.named_parameters(remove_duplicate=False)} - \
            {n for n, p in skeleton.named_parameters()}
        self._layers: dict[str, set[str]] = {}
        for n in self._shapes:
            self._layers.setdefault(_layer_of(n), set()).add(n)
        self._arch = type(skeleton).__name__
        del skeleton

        self.tp = self._check_tp(tp, hf_config, device)
        self._sleep_mode = device != "cpu" and torch.cuda.is_available()
        args = EngineArgs(
            model=str(path), skip_tokenizer_init=True, dtype=dtype, seed=self.seed,
            max_model_len=max_model_len, max_num_seqs=max_concurrency,
            # vLLM's step budget counts decode tokens too: one per running request beyond the prefill cap
            max_num_batched_tokens=min(max_prefill_tokens + max_concurrency, max_concurrency * max_model_len),
            logprobs_mode="processed_logprobs", max_logprobs=1, enforce_eager=enforce_eager,
            async_scheduling=False,     # a step's tokens come back from that step: versions stay exact
            enable_prefix_caching=sync_kv == "recompute", disable_log_stats=False,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=self._sleep_mode, tensor_parallel_size=self.tp,
            distributed_executor_backend="external_launcher" if self.tp > 1 else None)
        config = args.create_engine_config()
        block = config.cache_config.block_size
        if kv_cache_gb > 0:
            config.cache_config.kv_cache_memory_bytes = int(kv_cache_gb * 2**30)
        else:
            blocks = math.ceil(kv_budget_tokens / block) + 1     # + vLLM's null block
            config.cache_config.num_gpu_blocks_override = blocks
            if device == "cpu":
                config.cache_config.kv_cache_memory_bytes = blocks * block * kv_bytes_per_token(
                    hf_config, getattr(torch, dtype), self.tp)
        if device.startswith("cuda:"):
            config.device_config.device = torch.device(device)   # the executor takes its local rank from it
        self._tally = _Tally()
        self._llm = LLMEngine.from_vllm_config(config, stat_loggers=[_stat_logger(self._tally)],
                                               disable_log_stats=False)
        # vLLM's in-process teardown (run at exit) destroys torch.distributed's default group, which
        # is the job's, and raises when the job has already destroyed it: process exit frees the rest.
        finalizer = getattr(self._llm.engine_core, "_finalizer", None)
        if finalizer is not None:
            finalizer.detach()
        self.block_size = block
        self.kv_tokens_budget = (self._llm.vllm_config.cache_config.num_gpu_blocks - 1) * block

        self._queue: deque[Request] = deque()
        self._live: dict[str, _Live] = {}
        self._ready: list[Completion] = []
        self._ids: set[int] = set()
        self._admissions = 0
        self._asleep = False

    @classmethod
    def from_config(cls, model, cfg, *, device: str = "cpu", seed: int = 0, version: int = 0,
                    tp: int = 1) -> "VllmEngine":
        """Build from the ``[rollout]`` section over the directory ``model`` was loaded from, then load
        ``model``'s own weights into it (``tp``: ranks of one tensor-parallel instance, each calling this)."""
        path = getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "")
        dtype = _DTYPES.get(next(model.parameters()).dtype, "float32")
        engine = cls(path, max_concurrency=cfg.max_concurrency, kv_budget_tokens=cfg.kv_budget_tokens,
                     max_model_len=cfg.max_model_len, max_prefill_tokens=cfg.max_prefill_tokens, seed=seed,
                     version=version, dtype=dtype, kv_cache_gb=cfg.vllm_kv_cache_gb,
                     gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
                     enforce_eager=cfg.vllm_enforce_eager, device=str(device), tp=tp, sync_kv=cfg.sync_kv)
        engine.load_weights(((n, p.detach()) for n, p in model.named_parameters()), version)
        return engine

    @staticmethod
    def _check_tp(tp: int, hf_config, device: str) -> int:
        """A tensor-parallel instance is ``tp`` consecutive ranks of the job's torch.distributed world, each
        building its engine with the same arguments; vLLM's external-launcher executor then runs one
        worker per rank and lays its TP groups over that world (every rank of the world must build an
        engine with the same ``tp``). Returns ``tp`` once that holds, with ``RANK``/``LOCAL_RANK`` set
        for vLLM, which reads them."""
        import torch.distributed as dist

        tp = int(tp)
        if tp == 1:
            return 1
        if tp < 1:
            raise ValueError(f"resources.rollout_tp_size = {tp}: must be at least 1")
        heads = hf_config.num_attention_heads
        if heads % tp:
            raise ValueError(f"resources.rollout_tp_size = {tp}: the model's {heads} attention heads do not split "
                             f"over {tp} ranks")
        if not dist.is_initialized() or dist.get_world_size() % tp:
            found = f"{dist.get_world_size()} rank(s)" if dist.is_initialized() else "not initialised"
            raise ValueError(f"resources.rollout_tp_size = {tp}: needs the job's torch.distributed world, a "
                             f"multiple of {tp} ranks (this process's world: {found})")
        os.environ["RANK"] = str(dist.get_rank())
        os.environ["LOCAL_RANK"] = device.split(":", 1)[1] if device.startswith("cuda:") else str(dist.get_rank())
        return tp

    # ----------------------------------------------------------------------------------------
    # Interface
    # ----------------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue one request (a sample, possibly the continuation of a partial one)."""
        request = self._checked(request)
        self._ids.add(request.request_id)
        p, n = len(request.prompt), len(request.response_prefix)
        if n >= request.sampling.max_new_tokens or p + n >= self.max_model_len:
            self._ready.append(self._completion(request.request_id, request.prompt, list(request.response_prefix),
                                                list(request.prefix_logprobs), list(request.prefix_versions),
                                                "length"))
            return
        enqueue(self._queue, request, _continues)

    def step(self) -> list[Completion]:
        """Admit up to the cap, run one vLLM step, return the requests that finished."""
        if self._asleep:
            raise RuntimeError("vllm engine: step() while asleep; call wake() first")
        done, self._ready = self._ready, []
        self._admit()
        if self._live:
            for out in self._llm.step():
                live = self._live.get(out.request_id)
                if live is None:
                    continue
                o = out.outputs[0]
                for tok, lp in zip(o.token_ids, o.logprobs or ()):
                    live.tokens.append(int(tok))
                    live.logprobs.append(float(lp[tok].logprob))
                    live.versions.append(self.version)
                if len(o.token_ids) != len(o.logprobs or ()):
                    raise RuntimeError(f"vllm engine: request {live.request_id}: {len(o.token_ids)} tokens "
                                       f"but {len(o.logprobs or ())} log-probs in one step")
                if out.finished:
                    del self._live[out.request_id]
                    done.append(self._completion(live.request_id, live.prompt, live.tokens, live.logprobs,
                                                 live.versions, o.finish_reason or "abort"))
        if not self._live:
            self._tally.running = self._tally.waiting = 0
            self._tally.kv_usage = 0.0
        for c in done:
            self._ids.discard(c.request_id)
        return done

    def abort_all(self) -> list[Completion]:
        """Every unfinished request as a partial Completion (finish reason "abort"); engine empty."""
        out = self._ready
        out += [c for c, _ in self._take_live()]
        for r in self._queue:
            out.append(self._completion(r.request_id, r.prompt, list(r.response_prefix), list(r.prefix_logprobs),
                                        list(r.prefix_versions), "abort"))
        self._ready, self._queue = [], deque()
        self._ids.clear()
        return out

    def abort(self, request_ids: Iterable[int]) -> None:
        """End these requests wherever they are (inside vLLM, queued here, or ended but not yet returned)
        without returning them; ids not in the engine are ignored. The others run on."""
        ids = set(request_ids) & self._ids
        if not ids:
            return
        inside = [ext for ext, live in self._live.items() if live.request_id in ids]
        if inside:
            self._llm.abort_request(inside)
            for ext in inside:
                del self._live[ext]
        self._queue = deque(r for r in self._queue if r.request_id not in ids)
        self._ready = [c for c in self._ready if c.request_id not in ids]
        self._ids -= ids

    def load_weights(self, state: Mapping[str, object] | Iterable[tuple[str, object]], version: int) -> None:
        """Load tensors (Hugging Face names; whole vLLM layers, any order) into the model vLLM runs, in
        place; running requests re-prefill under them (or with ``sync_kv="keep"`` decode on) and their
        later tokens carry ``version``."""
        items = state.items() if isinstance(state, Mapping) else state
        keep = self.sync_kv == "keep"
        if not keep:      # requests inside vLLM go back to the queue first: they re-prefill under the new weights
            self._requeue_live()
        problems: list[str] = []
        pending: dict[str, dict[str, torch.Tensor]] = {}

        def checked() -> Iterator[tuple[str, torch.Tensor]]:
            # Stops at the first bad tensor instead of raising inside vLLM's reload, which would leave
            # its layers half restored; a layer is handed over once all its tensors are here.
            for name, value in items:
                if name in self._tied:
                    continue                      # vLLM ties it to the tensor it shares
                shape = self._shapes.get(name)
                if shape is None:
                    problems.append(f"load_weights: unknown tensor {name!r} (not a parameter of the {self._arch})")
                    return
                value = torch.as_tensor(value)
                if tuple(value.shape) != shape:
                    problems.append(f"load_weights: {name} has shape {tuple(value.shape)}, the model's is {shape}")
                    return
                layer = _layer_of(name)
                got = pending.setdefault(layer, {})
                got[name] = value
                if len(got) == len(self._layers[layer] - self._tied):
                    yield from pending.pop(layer).items()

        self._llm.collective_rpc(_reload, args=(checked(),))
        if not problems and pending:
            layer, got = next(iter(pending.items()))
            missing = sorted(self._layers[layer] - self._tied - set(got))
            problems.append(f"load_weights: {', '.join(sorted(got))} without {', '.join(missing)}: vLLM loads them "
                            f"into one layer ({layer}), so they must come in the same call; that layer kept its weights")
        if not keep and not self._llm.reset_prefix_cache():     # cached blocks hold KV of the old weights
            raise RuntimeError("vllm engine: the prefix cache could not be reset after a weight load")
        if problems:
            raise ValueError(problems[0])
        self.version = int(version)

    def sleep(self) -> None:
        """Free vLLM's KV cache and offload its weights where it can (CUDA); unfinished requests stay."""
        if self._asleep:
            return
        if self._sleep_mode:
            self._requeue_live()
            self._llm.sleep(level=1)
        self._asleep = True

    def wake(self) -> None:
        """Undo :meth:`sleep`."""
        if not self._asleep:
            return
        if self._sleep_mode:
            self._llm.wake_up()
        self._asleep = False

    def set_concurrency_cap(self, cap: int) -> None:
        """Let at most ``cap`` requests (1 to ``max_concurrency``) into vLLM at once; requests already in
        finish, none is preempted for a lowered cap."""
        self.concurrency_cap = max(1, min(int(cap), self.max_concurrency))

    def stats(self) -> EngineStats:
        t = self._tally
        # vLLM's counts date from its latest step; an abort since then has taken requests out of it.
        inside = len(self._live)
        running = min(t.running, inside)
        waiting = min(t.waiting, inside - running)
        return EngineStats(running=running, queued=waiting + len(self._queue),
                           kv_tokens_used=int(round(t.kv_usage * self.kv_tokens_budget)),
                           kv_tokens_budget=self.kv_tokens_budget,
                           preemptions=t.preemptions,
                           generated_tokens=t.generated, version=self.version)

    def has_unfinished(self) -> bool:
        return bool(self._live or self._queue or self._ready)

    def running_ids(self) -> list[int]:
        """Request ids inside vLLM now (admitted; most are running)."""
        return [live.request_id for live in self._live.values()]

    # ----------------------------------------------------------------------------------------
    # Requests in and out
    # ----------------------------------------------------------------------------------------

    def _checked(self, request: Request) -> Request:
        """The request with its prefix arrays filled in; a one-line error for anything vLLM would refuse."""
        rid, sp = int(request.request_id), request.sampling
        if rid in self._ids:
            raise ValueError(f"request {rid}: a request with this id is already in the engine")
        if sp.top_p != 1:
            raise ValueError(f"request {rid}: top_p = {sp.top_p}: the vllm engine needs 1 (vLLM's log-probs are "
                             f"taken after top-p truncation, which the trainer does not recompute)")
        return checked_request(request, vocab_size=self.vocab_size, max_model_len=self.max_model_len)

    def _requeue_live(self) -> None:
        """Every request inside vLLM back to the head of the queue, as a continuation (re-prefilled later)."""
        self._queue.extendleft(reversed([c.as_request(sp) for c, sp in self._take_live()]))

    def _admit(self) -> None:
        while self._queue and len(self._live) < self.concurrency_cap:
            r = self._queue.popleft()
            sp, n = r.sampling, len(r.response_prefix)
            context = np.concatenate([r.prompt, r.response_prefix]).tolist()
            key = stream_key(self.seed, r.request_id) if sp.seed is None else stream_key(sp.seed)
            params = VllmSamplingParams(
                temperature=sp.temperature, top_p=1.0,
                max_tokens=min(sp.max_new_tokens - n, self.max_model_len - len(context)),
                stop_token_ids=[t for t in sp.stop_ids if 0 <= t < self.vocab_size],   # vLLM refuses others
                ignore_eos=True, logprobs=0, detokenize=False,
                seed=stream_key(key, n) & (2**63 - 1), output_kind=RequestOutputKind.DELTA)
            # A fresh vLLM id per admission: an aborted request may come back under its own id.
            ext = f"{r.request_id}.{self._admissions}"
            self._admissions += 1
            self._llm.add_request(ext, TokensPrompt(prompt_token_ids=context), params)
            self._live[ext] = _Live(r.request_id, r.prompt, sp, r.response_prefix.tolist(), r.prefix_logprobs.tolist(),
                                    r.prefix_versions.tolist())

    def _take_live(self) -> list[tuple[Completion, SamplingParams]]:
        """Abort every request inside vLLM; their partial completions and sampling params, in admission order."""
        if not self._live:
            return []
        self._llm.abort_request(list(self._live))
        out = []
        for live in self._live.values():
            c = self._completion(live.request_id, live.prompt, live.tokens, live.logprobs, live.versions, "abort")
            out.append((c, live.sampling))
        self._live.clear()
        self._tally.running = self._tally.waiting = 0
        self._tally.kv_usage = 0.0
        if self._llm.has_unfinished_requests():
            raise RuntimeError("vllm engine: requests left in vLLM after aborting all of them")
        return out

    @staticmethod
    def _completion(rid: int, prompt, tokens, logprobs, versions, reason: str) -> Completion:
        return Completion(request_id=rid, prompt=np.asarray(prompt, dtype=np.int32),
                          response=np.asarray(tokens, dtype=np.int32), logprobs=np.asarray(logprobs, dtype=np.float32),
                          versions=np.asarray(versions, dtype=np.int32), finish_reason=reason)
