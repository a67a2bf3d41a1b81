"""EngineCore: the step loop both roles share (scheduler + cache manager + runner + stop checks).

    add_request -> [waiting] --schedule--> [running] --execute--> sampled tokens --check_stop--> outputs
    begin_import -> [waiting for transfer] --complete_import--> [waiting] ...   (engine/transfer.py, decode side)
                                           --run_unconfirmed--> [waiting] ... output held back until confirmed

Ownership: one thread calls add_request/step/abort (workers serialise calls onto their step thread).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from hybridpd.engine.async_step import StepPipeline
from hybridpd.engine.cache.coordinator import HybridCacheManager
from hybridpd.engine.cache.planner import CapacityError, CapacityPlan, plan_capacity
from hybridpd.engine.cache.specs import group_layers
from hybridpd.engine.config import EngineConfig, resolve_max_model_len
from hybridpd.engine.detokenizer import IncrementalDetokenizer
from hybridpd.engine.device import describe_auto, require_device, require_fast_path, resolve_device, resolve_dtype
from hybridpd.engine.errors import InvalidRequestError
from hybridpd.engine.memory_fit import (
    GpuBudget,
    activation_reserve,
    fmt_bytes,
    gpu_budget,
    largest_fitting,
    no_fit_error,
    require_cache_room,
    smallest_fitting,
)
from hybridpd.engine.parallel.executor import LeaderRunner, start_tensor_parallel
from hybridpd.engine.parallel.group import TPGroup
from hybridpd.engine.parallel.shard import check_shardable, shard_model
from hybridpd.engine.prompt_logprobs import PromptLogprobs, ScoredRows
from hybridpd.engine.request import Request, RequestOutput
from hybridpd.engine.runner import ModelRunner
from hybridpd.engine.sampling_params import SamplingParams
from hybridpd.engine.scheduler import Scheduler, SchedulerOutput
from hybridpd.engine.structured.matchers import StructuredOutputs

if TYPE_CHECKING:
    from hybridpd.engine.transfer import Import

log = logging.getLogger("hybridpd.engine")

DEFAULT_CPU_CACHE_BYTES = 256 * 2**20


@dataclass
class StepStats:
    """Monotonic counters of the step loop. Step times are wall clock of `EngineCore.step` (schedule, execute with
    sampling, update): by kind, "decode" (every scheduled sequence computes one token) or "prefill" (any prompt
    chunk), so a router's cost model can read seconds per token of each kind (worker metrics export them)."""

    num_steps: int = 0
    num_scheduled_tokens: int = 0
    step_seconds: dict[str, float] = field(default_factory=lambda: {"decode": 0.0, "prefill": 0.0})
    steps: dict[str, int] = field(default_factory=lambda: {"decode": 0, "prefill": 0})
    step_tokens: dict[str, int] = field(default_factory=lambda: {"decode": 0, "prefill": 0})

    def record(self, num_seqs: int, num_tokens: int, seconds: float) -> None:
        self.num_steps += 1
        self.num_scheduled_tokens += num_tokens
        if not num_seqs:
            return
        kind = "decode" if num_tokens == num_seqs else "prefill"
        self.step_seconds[kind] += seconds
        self.steps[kind] += 1
        self.step_tokens[kind] += num_tokens


class EngineCore:
    pipeline: StepPipeline | None = None
    """Asynchronous scheduling (engine.async_step): the step in flight; None: every step is synchronous."""

    def __init__(self, config: EngineConfig, tp: TPGroup | None = None) -> None:
        """`tp`: this process is a tensor-parallel follower rank (engine.parallel.executor); None: rank 0, which
        spawns the followers when config.parallel.tensor_parallel_size > 1."""
        from hybridpd.engine.models.registry import read_model_config

        config.validate()
        hf_config = read_model_config(config.model.path)
        config = resolve_auto(config, hf_config)
        self.config = config
        mc = config.model
        require_device(mc.device)
        require_fast_path(mc.device, mc.allow_reference_path)
        self.device = torch.device(mc.device)
        self.max_model_len = resolve_max_model_len(mc.max_model_len, hf_config, mc.path)
        world = config.parallel.tensor_parallel_size
        if tp is None and world > 1:  # a model that cannot be cut fails here, before any other rank starts
            try:
                check_shardable(mc.path, world, config.parallel.enable_expert_parallel)
            except ValueError as e:
                raise InvalidRequestError(f"tensor parallelism: {e}") from None
        self.followers = start_tensor_parallel(config) if tp is None else None
        self.tp = self.followers.tp if self.followers is not None else tp
        try:
            self._start(config, hf_config)
        except BaseException:
            if self.followers is not None:  # stop the ranks this engine started: the caller sees only its error
                self.followers.abort()
                self.followers = None
            raise

    def _start(self, config: EngineConfig, hf_config: dict[str, Any]) -> None:
        """Everything after the ranks exist: the model (rank's slice), the cache plan every rank agrees on, the
        scheduler, the runner, the tokenizer."""
        from hybridpd.engine.models.registry import load_model

        mc, cc = config.model, config.cache
        self.model = load_model(mc.path, mc.dtype, mc.device, mc.load_format)
        self._exchange_bytes = 0
        """GPU memory of the fused all-reduce's exchange buffer (outside the caching allocator's counts)."""
        if self.tp is not None:
            from hybridpd.engine.parallel import fused_allreduce  # Triton: loaded only where ranks exist

            shard_model(self.model, self.tp, config.parallel.enable_expert_parallel)
            self._exchange_bytes = fused_allreduce.build(self.tp, self.model, self.device,
                                                         self.model.lm_head.weight.dtype,
                                                         min(config.scheduler.max_num_seqs, 256))
        specs = self.model.cache_specs(cc.block_size)
        self.groups = group_layers(specs)
        self.has_recurrent = any(not g.is_attention for g in self.groups)
        self._memory_note = ""
        """On CUDA: the share, weights and activation reserve the cache budget was derived from (for errors)."""
        self._gpu: GpuBudget | None = None
        self.plan = self._plan(specs)
        log.info(self.plan.log_line())
        agreed = (self.plan.log_line(), self.plan.arena is not None and self.plan.arena.pages_are_blocks)
        if self.tp is not None and len(set(self.tp.gather_objects(agreed))) != 1:
            raise RuntimeError("tensor-parallel ranks planned different caches; block ids would not agree")
        sc = self.config.scheduler  # max_num_seqs may have been lowered to what the memory holds
        self.cache = HybridCacheManager(self.groups, self.plan.layout(), cc.enable_prefix_caching)
        self.scheduler = Scheduler(sc, self.cache)
        zero = cc.zero_fresh_blocks == "on" or (cc.zero_fresh_blocks == "auto" and self.has_recurrent)
        num_layers = _num_layers(self.model, specs)
        self.runner = ModelRunner(self.model, self.groups, self.plan, num_layers, self.device, mc.seed, zero)
        asynchronous = config.scheduler.async_scheduling
        self.async_scheduling = self.device.type == "cuda" if asynchronous is None else asynchronous
        if self.tp is not None and self.async_scheduling:
            self.runner.token_group = self.tp  # every rank needs the samples its next (fed) step reads
        if self.followers is not None:
            self.runner = LeaderRunner(self.runner, self.followers.tp, self.followers.fail)  # type: ignore[assignment]
            self.followers.before_leave = self.runner.release_graphs  # NCCL: graphs die before the group
        self.eos_token_ids = tuple(self.model.eos_token_ids)
        self.vocab_size = int(self.model.vocab_size)
        self.tokenizer = self._load_tokenizer(mc.tokenizer or mc.path)
        self.runner.sampler.bind(self.scheduler.requests.get, self.eos_token_ids)
        self.structured = StructuredOutputs(self.tokenizer, self.vocab_size, self.eos_token_ids,
                                            self.scheduler.requests.get)
        """Grammar cache + one matcher per constrained request (engine.structured); masks applied by the sampler."""
        self.runner.sampler.bind_constraint(self.structured.apply)
        policy = cc.cache_policy()
        log.info(
            "engine: model %s, %s on %s, block size %d, prefix caching %s, checkpoints %s%s, "
            "zero fresh blocks %s, max %d seqs x %d batched tokens, max_model_len %d, %s path%s%s",
            mc.path, mc.dtype, self.device, cc.block_size, "on" if cc.enable_prefix_caching else "off",
            self.cache.admission.name, f" (interval {policy.interval})" if policy.interval else "",
            "on" if zero else "off", self.config.scheduler.max_num_seqs, self.config.scheduler.max_num_batched_tokens,
            self.max_model_len, "batched (fast)" if self.runner.fast_path else "reference",
            "" if not self.runner.fast_path else (", CUDA graphs" if self.runner.graphs is not None else ", eager"),
            ", asynchronous scheduling" if self.async_scheduling else "",
        )
        self.stats = StepStats()
        self.finish_listeners: list[Callable[[Request], None]] = []
        """Called (step thread) for every request `finish` ends; AsyncEngine delivers them to streams/callbacks."""
        self.transfer_canceller: Callable[[str], bool] | None = None
        """Set by the decode worker: cancel the transfer into an importing request's pages; returns whether the
        pages may be reused (False: a READ may still land, so they are quarantined). Called when the engine itself
        ends an import (abort, deadline, a failed step); None: nothing can write them (reusable)."""
        self.clock: Callable[[], float] = time.monotonic
        """For import deadlines (Import.deadline)."""
        self._next_arrival = 0
        if self.async_scheduling:
            self.pipeline = StepPipeline(self)

    # -- setup ---------------------------------------------------------------------------------------------------
    def _plan(self, specs: dict) -> CapacityPlan:
        cc, sc = self.config.cache, self.config.scheduler
        budget = cc.kv_cache_memory_bytes
        if budget is None:
            budget = self._cuda_budget() if self.device.type == "cuda" else DEFAULT_CPU_CACHE_BYTES
        elif self.device.type == "cuda":  # an explicit size: refused with the numbers when the GPU lacks it
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            require_cache_room(budget, total, free, torch.cuda.memory_reserved(self.device),
                               torch.cuda.memory_allocated(self.device))
        if self.tp is not None:  # one plan for every rank: the budget all of them can hold
            budget = self.tp.agree_min(budget)
        # one arena (engine/arena.py): blocks and checkpoints share its pages, so the plan's physical bytes are the
        # budget; num_checkpoint_slots only caps the cached checkpoints (None: as many as fit)
        def plan(num_seqs: int, max_model_len: int = 0, budget: int = budget) -> CapacityPlan | None:
            """The plan for `num_seqs` running requests, None when it cannot hold one max_model_len request."""
            max_model_len = max_model_len or self.max_model_len
            try:
                p = plan_capacity(self.groups, budget, num_seqs, cc.num_checkpoint_slots, max_model_len,
                                  cc.resolved_checkpoint_interval(), policy=cc.cache_policy(),
                                  block_size=cc.block_size)
            except CapacityError:
                return None
            return None if p.attention_blocks and p.token_capacity < max_model_len else p

        fitted = fit_running_seqs(plan, sc.max_num_seqs) if budget > 0 else None
        if fitted is None and self.config.model.max_model_len == -1 and budget > 0:  # auto-fit (vLLM's -1 / auto)
            longest = largest_fitting(lambda n: plan(1, n) is not None, self.max_model_len - 1)
            if longest > 1:
                log.info("auto-fit max_model_len: reduced from %d to %d, the longest request the cache budget (%s%s) "
                         "holds", self.max_model_len, longest, fmt_bytes(budget), self._memory_note)
                self.max_model_len = longest
                fitted = fit_running_seqs(plan, sc.max_num_seqs)
        if fitted is None:

            def holds(length: int, nbytes: int) -> bool:
                return plan(1, length, nbytes) is not None

            raise self._no_fit(budget, holds)
        if fitted.state_slots_running and fitted.state_slots_running < sc.max_num_seqs:
            log.warning("max_num_seqs lowered from %d to %d: the cache budget (%s%s) holds that many running "
                        "requests with room for one of max_model_len=%d", sc.max_num_seqs,
                        fitted.state_slots_running, fmt_bytes(budget), self._memory_note, self.max_model_len)
            self.config = dataclasses.replace(
                self.config, scheduler=dataclasses.replace(sc, max_num_seqs=fitted.state_slots_running))
        return fitted

    def _no_fit(self, budget: int, fits: Callable[[int, int], bool]) -> InvalidRequestError:
        """The error of a cache budget that holds no request of max_model_len, with the numbers. `fits(length,
        budget)`: whether `budget` bytes hold one request of `length` tokens."""
        cc = self.config.cache
        one = plan_capacity(self.groups, 1 << 50, 1, 0, self.max_model_len, cc.resolved_checkpoint_interval(),
                            block_size=cc.block_size)
        need = smallest_fitting(lambda b: fits(self.max_model_len, b), 1 << 50)
        largest = largest_fitting(lambda n: fits(n, budget), self.max_model_len - 1) if budget > 0 else 0
        return no_fit_error(self.max_model_len, one.bytes_per_token, one.bytes_per_state, need, budget, largest,
                            self._gpu)

    def _cuda_budget(self) -> int:
        """This instance may use gpu_memory_utilization * total (vLLM's meaning: other processes on the GPU are
        not subtracted, but the share must be free): minus weights and the activation peak of a max-size step."""
        torch.cuda.synchronize(self.device)
        # hand the allocator's cached free blocks back first (weight loading leaves its temporaries cached): else the
        # process holds them on top of its share, and two workers sharing a GPU can run it out of memory
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        hidden = int(getattr(self.model, "hidden_size", 4096))
        gpu = gpu_budget(total, free, torch.cuda.memory_reserved(self.device),
                         torch.cuda.memory_allocated(self.device), self.config.cache.gpu_memory_utilization,
                         activation_reserve(self.config.scheduler.max_num_batched_tokens, hidden,
                                            self.vocab_estimate()), exchange=self._exchange_bytes)
        self._gpu, self._memory_note = gpu, gpu.note()
        log.info("GPU memory: share %s (gpu_memory_utilization %.2f of %s), weights %s, activation reserve %s, "
                 "all-reduce exchange %s, cache budget %s", fmt_bytes(gpu.share), gpu.utilization,
                 fmt_bytes(gpu.total), fmt_bytes(gpu.weights), fmt_bytes(gpu.activation), fmt_bytes(gpu.exchange),
                 fmt_bytes(gpu.cache))
        return gpu.cache

    def vocab_estimate(self) -> int:
        return int(getattr(self.model, "vocab_size", 32000))

    @staticmethod
    def _load_tokenizer(path: str):  # type: ignore[no-untyped-def]
        try:
            from hybridpd.engine.tokenizer import Tokenizer

            return Tokenizer.from_pretrained(path)
        except Exception as e:  # noqa: BLE001 - a checkpoint without tokenizer still serves token ids
            log.warning("no tokenizer loaded from %s (%s): text output disabled", path, e)
            return None

    # -- requests ------------------------------------------------------------------------------------------------
    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise InvalidRequestError("prompt is empty: at least one token is required")
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {n} tokens; max_model_len is {self.max_model_len} (prompt plus at least one generated "
                f"token must fit)"
            )
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or t < 0 or t >= self.vocab_size]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})")

    def new_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, cache_salt: str | None = None,
        compute_target: int | None = None, prefill_only: bool = False,
    ) -> Request:
        """A validated request, not yet scheduled."""
        self.validate_prompt(prompt_token_ids)
        bad_bias = [t for t, _ in params.logit_bias or () if t >= self.vocab_size]  # type: ignore[misc]
        if bad_bias:
            raise InvalidRequestError(f"logit_bias token id {bad_bias[0]} is outside the vocabulary "
                                      f"[0, {self.vocab_size})")
        bad_allowed = [t for t in params.allowed_token_ids or () if t >= self.vocab_size]
        if bad_allowed:
            raise InvalidRequestError(f"allowed_token_ids token id {bad_allowed[0]} is outside the vocabulary "
                                      f"[0, {self.vocab_size})")
        if params.bad_words:  # tokenized here, as vLLM's engine does (update_from_tokenizer)
            if self.tokenizer is None:
                raise InvalidRequestError("bad_words need the model's tokenizer, and this engine has none")
            params = params.with_bad_words_token_ids(self.tokenizer.encode)
            bad_word = [t for seq in params.bad_words_token_ids for t in seq if t >= self.vocab_size]
            if bad_word:
                raise InvalidRequestError(f"bad_words token id {bad_word[0]} is outside the vocabulary "
                                          f"[0, {self.vocab_size})")
        if params.structured is not None:  # compiled here, once per spec: a malformed one is refused up front
            self.structured.check(params.structured)
        req = Request(
            request_id=request_id, prompt_token_ids=list(prompt_token_ids), sampling_params=params,
            arrival_index=self._next_arrival, cache_salt=cache_salt, compute_target=compute_target,
            prefill_only=prefill_only,
            prompt_logprobs=None if params.prompt_logprobs is None else PromptLogprobs(params.prompt_logprobs),
        )
        self._next_arrival += 1
        return req

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, cache_salt: str | None = None,
        compute_target: int | None = None, prefill_only: bool = False,
    ) -> Request:
        req = self.new_request(request_id, prompt_token_ids, params, cache_salt, compute_target, prefill_only)
        self.scheduler.add_request(req)
        return req

    def finish(self, req: Request, reason: str, free_caches: bool = True) -> None:
        """The one place a request ends (stop, length, prefilled, abort, error; scheduled or not): the scheduler lets
        it go (its caches freed unless `free_caches` is False: a prefill worker pins them, an importing request
        already gave them back), the sampler forgets it, and `finish_listeners` hear of it (step thread)."""
        if req.request_id in self.scheduler.importing:
            free_caches = self._give_back_import(req)
        elif req.request_id in self.scheduler.unconfirmed:  # ends before its transfer was confirmed: none of it out
            self._give_back_unconfirmed(req)
        if free_caches and self.pipeline is not None and self.pipeline.defer_free(req):
            free_caches = False  # a launched step still computes it: its pages are freed once that step is done
        self.scheduler.finish(req, reason, free_caches=free_caches)
        self.runner.sampler.forget(req.request_id)
        self.structured.forget(req.request_id)
        for listener in self.finish_listeners:
            listener(req)

    def _give_back_import(self, req: Request) -> bool:
        """An importing request ends or is let go: cancel its transfer; its pages are freed by the caller when that
        returns True (the reserved checkpoint here), else quarantined here."""
        imp = self.scheduler.importing[req.request_id]
        reusable = self.transfer_canceller(req.request_id) if self.transfer_canceller is not None else True
        return self.drop_import_pages(req, imp, reusable, free_caches=False)

    def _give_back_unconfirmed(self, req: Request) -> None:
        """A request running on an unconfirmed transfer ends (abort, error): its held output is dropped, its
        transfer cancelled (the READ is done: nothing lands any more) and the checkpoint reserved for it let go."""
        imp = self.scheduler.unconfirmed.pop(req.request_id)
        if self.transfer_canceller is not None:
            self.transfer_canceller(req.request_id)
        if imp.checkpoint is not None:
            self.cache.drop_checkpoint(imp.checkpoint)
        self.drop_held_output(req)

    def drop_held_output(self, req: Request) -> None:
        """Cut the output back to what was produced before `req.held_from` (nothing held: no-op), as if the rest had
        never been sampled: stop reason, detokenizer, block hashes, the seeded generator (restarted past the kept
        draws) and the grammar matcher (rebuilt from the kept output) follow."""
        n = req.held_from
        if n is None:
            return
        req.held_from = req.held_finish = None
        if len(req.output_token_ids) == n:
            return
        del req.output_token_ids[n:], req.output_logprobs[n:], req.output_top_logprobs[n:]
        req.stop_reason, req.stop_text_end, req.detokenizer = None, None, None
        del req.block_hashes[req.num_tokens // self.cache.block_size:]
        sampler = self.runner.sampler
        sampler.forget(req.request_id)
        sampler.skip_samples(req.request_id, req.sampling_params, n)
        self.structured.forget(req.request_id)

    def drop_import_pages(self, req: Request, imp: Import, reusable: bool, free_caches: bool = True) -> bool:
        """Give an import's destination pages back unpublished (`reusable`), or quarantine them (a READ may still
        write them). With free_caches False the request's own pages are left to the caller (`finish`)."""
        ckpt = imp.checkpoint
        if not reusable:
            log.error("request %s: transfer could not be cancelled; its pages are quarantined", req.request_id)
            self.cache.quarantine(req, ckpt)
            return False
        if ckpt is not None:
            self.cache.drop_checkpoint(ckpt)
        if free_caches:
            self.cache.free(req)
        return True

    def expire_imports(self) -> list[Request]:
        """End imports past their deadline (Import.deadline): the transfer is cancelled, the pages given back (or
        quarantined), and the request computed here ("recompute") or ended with an error ("fail"), per the
        Import's fallback. Returns them. Called before every step; workers may call it from a hook too."""
        expired = self.scheduler.expired_imports(self.clock())
        for req in expired:
            imp = self.scheduler.importing[req.request_id]
            self._give_back_import(req)
            self.cache.free(req)  # no-op if quarantined (the request holds nothing then)
            self.scheduler.drop_import(req)
            log.warning("request %s: transfer deadline passed; %s", req.request_id, imp.fallback)
            if imp.fallback == "recompute":
                req.num_computed_tokens = 0
                self.scheduler.add_request(req)
            else:
                req.stop_reason = "transfer deadline passed"
                self.finish(req, "error", free_caches=False)
        return expired + self._expire_unconfirmed()

    def _expire_unconfirmed(self) -> list[Request]:
        """Requests running on a transfer never confirmed by its deadline (the answer lost): refused, as a no."""
        from hybridpd.engine.transfer import refuse_unconfirmed

        expired = self.scheduler.expired_unconfirmed(self.clock()) if self.scheduler.unconfirmed else []
        for req in expired:
            imp = self.scheduler.unconfirmed[req.request_id]
            if self.transfer_canceller is not None:
                self.transfer_canceller(req.request_id)  # a late answer finds nothing to confirm
            log.warning("request %s: transfer unconfirmed at its deadline; %s", req.request_id, imp.fallback)
            refuse_unconfirmed(self, req, imp.fallback, "transfer deadline passed")
        return expired

    def abort(self, request_id: str) -> Request | None:
        """End a scheduled or importing request ("abort"); returns it, or None if it is not known."""
        req = self.scheduler.requests.get(request_id)
        if req is not None:
            self.finish(req, "abort")
        return req

    def fail_all(self, reason: str) -> None:
        """End every scheduled request with an error (its caches freed): what a failed step leaves behind. Requests
        waiting for a transfer were not in the step and keep waiting."""
        importing = self.scheduler.importing
        for req in [r for r in self.scheduler.requests.values() if r.request_id not in importing]:
            req.stop_reason = reason
            self.finish(req, "error")

    def next_import_deadline(self) -> float | None:
        """The earliest deadline (engine clock) of an import or an unconfirmed transfer; None when none has one.
        An idle worker wakes by then to enforce it (`expire_imports`)."""
        sched = self.scheduler
        deadlines = [imp.deadline for imps in (sched.importing, sched.unconfirmed) for imp in imps.values()
                     if imp.deadline is not None]
        return min(deadlines, default=None)

    @property
    def num_importing(self) -> int:
        """Requests waiting for a transfer (WAITING_FOR_TRANSFER)."""
        return len(self.scheduler.importing)

    def has_unfinished(self) -> bool:
        """Requests a step can advance (importing ones wait for their transfer; see expire_imports), or a step still
        in flight (asynchronous scheduling: one of ended requests only, its pages come back when it is read)."""
        in_flight = self.pipeline is not None and self.pipeline.in_flight is not None
        return self.scheduler.num_unfinished > 0 or in_flight

    def is_stalled(self) -> bool:
        """The last step found nothing to run and nothing changed since (`Scheduler.stalled`): another step would
        be as empty, so a step loop waits for a change instead."""
        return self.scheduler.stalled

    # -- the step ------------------------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Schedule, execute, update. Returns requests that advanced this step (finished ones included). With
        asynchronous scheduling the step after it may already be launched (engine.async_step.StepPipeline)."""
        if self.scheduler.importing or self.scheduler.unconfirmed:
            self.expire_imports()
        if self.pipeline is not None:
            return self.pipeline.step()
        t0 = time.perf_counter()
        out: SchedulerOutput = self.scheduler.schedule()
        try:
            sampled = self.runner.execute(out, self.step_params(out))
        except Exception:
            self.cache.on_step_failed()
            raise
        return self.process_step(out, sampled, self.runner.sampler.take_top_logprobs(), t0,
                                 self.runner.take_prompt_scores())

    def step_params(self, out: SchedulerOutput) -> dict[str, SamplingParams]:
        requests = self.scheduler.requests
        return {s.request_id: requests[s.request_id].sampling_params for s in out.seqs}

    def process_step(self, out: SchedulerOutput, sampled: dict[str, tuple[int, float]],
                     top_logprobs: dict[str, list[tuple[int, float]]], t0: float,
                     prompt_scores: Mapping[str, ScoredRows] | None = None) -> list[Request]:
        """A computed step's results into its requests: prompt scores, counts, tokens, published blocks, stop
        checks, finishes."""
        for rid, rows in (prompt_scores or {}).items():
            req = self.scheduler.requests.get(rid)
            if req is not None and req.prompt_logprobs is not None:
                req.prompt_logprobs.extend(rows)
        advanced = self.scheduler.update_from_output(out, sampled)
        for rid, top in top_logprobs.items():
            if rid in self.scheduler.requests:
                self.scheduler.requests[rid].output_top_logprobs.append(top)
        for req in advanced:
            if req.compute_target is not None and req.num_computed_tokens >= req.compute_target:
                self.finish(req, "prefilled", free_caches=False)
            elif req.request_id in sampled:
                reason = self.check_stop(req)
                if reason is None and req.sampling_params.structured is not None and not self.structured.accept(req):
                    reason = "stop"  # the grammar is complete (its end reached, e.g. the JSON object closed)
                if reason is not None and req.held_from is not None:
                    self.scheduler.park(req, reason)  # ends only once its transfer is confirmed
                elif reason is not None:
                    self.finish(req, reason)
                elif req.prefill_only:  # its first token is out: a consumer continues from it with these caches
                    self.finish(req, "prefilled", free_caches=False)
        self.stats.record(len(out.seqs), out.num_tokens, time.perf_counter() - t0)
        return advanced

    def check_stop(self, req: Request) -> str | None:
        p = req.sampling_params
        outputs = req.output_token_ids
        num_outputs = len(outputs)
        tok = outputs[-1]
        if num_outputs < p.min_tokens:  # EOS and stop ids were masked; stop strings wait too
            return "length" if self.length_reached(req) else None
        if not p.ignore_eos and tok in self.eos_token_ids:
            req.stop_reason = tok
            return "stop"
        if tok in p.stop_token_ids:
            req.stop_reason = tok
            return "stop"
        if p.stop and self.tokenizer is not None:
            # the text before this token (decoded now if no check saw it: under min_tokens, a first token from P)
            before = len(self._decoded(req, upto=len(req.output_token_ids) - 1))
            text = self._decoded(req)
            # only the new text and the few characters before it can complete a stop string not seen before
            start = max(0, before - max(len(s) for s in p.stop) + 1)
            tail = text[start:]
            for s in p.stop:
                if s in tail:
                    req.stop_reason = s
                    req.stop_text_end = start + tail.index(s) + len(s)
                    return "stop"
        # `length_reached(req)`, inlined: once per request per step
        if len(req.prompt_token_ids) + num_outputs >= self.max_model_len or num_outputs >= max(p.max_tokens,
                                                                                             p.min_tokens):
            return "length"
        return None

    def stop_match(self, req: Request) -> str | int | None:
        """vLLM's `stop_reason`: the stop string or stop token id that ended `req` with "stop"; None for an EOS
        (checked first, as vLLM does), a completed grammar or any other end."""
        reason = req.stop_reason
        if req.finish_reason != "stop" or reason is None:
            return None
        if isinstance(reason, str) or req.sampling_params.ignore_eos or reason not in self.eos_token_ids:
            return reason
        return None

    def length_reached(self, req: Request, ahead: int = 0) -> bool:
        """Whether `req`'s length ends it once `ahead` more tokens are in: max_model_len, or max_tokens (never before
        min_tokens). `check_stop`'s length rule; asynchronous scheduling asks it one token ahead."""
        p = req.sampling_params
        outputs = len(req.output_token_ids) + ahead
        return req.num_tokens + ahead >= self.max_model_len or outputs >= max(p.max_tokens, p.min_tokens)

    def _decoded(self, req: Request, upto: int | None = None) -> str:
        """The output text so far (of the first `upto` tokens when given), detokenized incrementally (O(new tokens)
        a step; engine/detokenizer.py); once the request has finished, including what was held back as an
        incomplete character."""
        detok = req.detokenizer
        if detok is None:
            detok = req.detokenizer = IncrementalDetokenizer(self.tokenizer, req.sampling_params.skip_special_tokens)
        if upto is not None:
            if detok.num_seen < upto:  # (behind: copy the prefix once, not every step)
                detok.update(req.output_token_ids[:upto])
        elif req.is_finished:
            detok.finish(req.output_token_ids)
        else:
            detok.update(req.output_token_ids)
        return detok.text

    def output_text(self, req: Request) -> str:
        if self.tokenizer is None:
            return ""
        text = self._decoded(req)
        end = req.stop_text_end
        if end is not None and isinstance(req.stop_reason, str):
            text = text[:end] if req.sampling_params.include_stop_str_in_output else text[: end - len(req.stop_reason)]
        return text

    def make_output(self, req: Request) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, token_ids=list(req.output_token_ids),
            text=self.output_text(req), logprobs=list(req.output_logprobs),
            num_cached_tokens=max(req.num_cached_tokens, 0), finish_reason=req.finish_reason,
            num_preemptions=req.num_preemptions, top_logprobs=list(req.output_top_logprobs),
            prompt_logprobs=None if req.prompt_logprobs is None else req.prompt_logprobs.as_dicts(self._token_text),
        )

    def _token_text(self, token_id: int) -> str | None:
        """One token's text as vLLM's `decoded_token` (None without a tokenizer)."""
        return None if self.tokenizer is None else self.tokenizer.decode([token_id], skip_special_tokens=False)

    def pool_health(self) -> list[dict[str, object]]:
        """Each pool's counts (group_id, kind, total, free, cached, in_use) and whether its integrity check passes
        now (workers report it through their Stats RPC). Step thread only."""
        out = []
        try:
            self.cache.check_integrity()
            ok = True
        except AssertionError:
            ok = False
        for s in self.cache.pool_stats():
            out.append({**s, "integrity_ok": ok})
        return out

    def queue_lengths(self) -> tuple[int, int]:
        """(running, waiting) requests of the scheduler. Running counts the parked ones too (ended on a transfer
        not confirmed yet): they hold their caches and a running state until the producer answers."""
        sched = self.scheduler
        return len(sched.running) + len(sched.parked), len(sched.waiting)

    def shutdown(self) -> None:
        """Destroy the CUDA graphs, stop the tensor-parallel follower ranks, if any, and leave their group (a later
        engine in this process may start its own)."""
        if self.followers is not None:
            self.followers.close()  # destroys rank 0's graphs before leaving the group (before_leave)
            self.followers = None
        self.runner.release_graphs()

    def kv_cache_info(self) -> dict[str, int]:
        """The plan, and the split as it is now: bytes held per kind, running vs cached."""
        info = self.plan.as_dict()
        stats = self.cache.cache_stats()
        for label in self.cache.labels.values():
            s = stats[label]
            info[f"{label}_bytes_in_use"] = s["bytes_in_use"]  # type: ignore[index]
            info[f"{label}_bytes_cached"] = s["bytes_cached"]  # type: ignore[index]
        if self.plan.arena is not None:  # one arena: the pages cached checkpoints take, as memory
            info["checkpoint_bytes_held"] = int(stats["checkpoint_pages"]) * self.plan.arena.page_bytes  # type: ignore[call-overload]
        return info


def fit_running_seqs(plan: Callable[[int], CapacityPlan | None], max_num_seqs: int) -> CapacityPlan | None:
    """The plan for the most running requests (at most `max_num_seqs`) whose reserved recurrent states still leave
    room for one request of max_model_len; None when even one does not fit. `plan(n)` is monotone: more running
    states leave less for attention."""
    best = plan(max_num_seqs)
    if best is not None:
        return best
    lo, hi = 0, max_num_seqs - 1  # invariant: plan(lo) fits or lo == 0; plan(hi + 1) does not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if plan(mid) is not None:
            lo = mid
        else:
            hi = mid - 1
    return plan(lo) if lo >= 1 else None


def resolve_auto(config: EngineConfig, hf_config: dict[str, Any] | None = None) -> EngineConfig:
    """The config with `device` / `dtype` "auto" replaced by what this machine runs the checkpoint (its config.json:
    `hf_config`) in (engine/device.py); what auto chose is logged."""
    mc = config.model
    device = resolve_device(mc.device)
    dtype = resolve_dtype(mc.dtype, device, hf_config)
    said = describe_auto(mc.device, mc.dtype, device, dtype, hf_config)
    if said:
        log.info("%s", said)
    model = dataclasses.replace(mc, device=device, dtype=dtype)  # type: ignore[arg-type]
    return dataclasses.replace(config, model=model)


def _num_layers(model: object, specs: dict) -> int:
    """Layers the model iterates over (caches are indexed by layer; MLP/MoE layers get None)."""
    n = getattr(model, "num_layers", None)
    if n is None:
        import torch.nn as nn

        lists = [m for name, m in model.named_modules() if name.endswith("layers") and isinstance(m, nn.ModuleList)]  # type: ignore[attr-defined]
        n = len(lists[0]) if lists else max(specs) + 1
    return int(n)
