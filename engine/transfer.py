"""The engine's side of a P/D handoff: what a prefilled request exports and how a consumer imports it. Tensor-free
values; the PD services translate them to and from protobuf and never touch the cache manager, scheduler or runner
themselves. All functions run on the engine's step thread.

    P (producer)                                   D (consumer)
    core.new_request(..., prefill_only=True)       req = core.new_request(...)
      computes N tokens, samples token 1,          first_token_problem(core, req, token 1)  None: go on
      finishes as "prefilled" (caches kept)        imp = begin_import(core, req, src)   allocate, choose pages;
    exp = export_prefilled(core, req)  pin           the scheduler holds req WAITING_FOR_TRANSFER
                                                   add_first_token(core, req, token 1)  continue from P's sample
      ... lease: D pulls, then commits ...         ... pull imp's src pages into its dst pages (NIXL) ...
    release_export(core, req, exp)     unpin       complete_import(core, req)  publish + runnable at n
                                                   or run_unconfirmed(core, req)  runnable at n at once, output
                                                      held back, nothing published; then, on P's answer,
                                                      confirm_import (publish, release) or refuse_unconfirmed
                                                      (drop the held output, recompute from 0 / fail)
                                                   or abort_import(core, req, imp, reusable) + schedule_local/fail
                                                   or core.abort / a deadline (Import.deadline) / a failed step

Every id is per cache group: an attention group's blocks, a recurrent group's running slot (several groups of each
kind are allowed; they travel as TransferParams.groups / .states). A checkpoint is k pages of the arena (every
recurrent group's state cut in page-sized pieces, engine/cache/arena.py): it travels as extra blocks of every
attention group (page j is block j of every attention group), between two single-rank engines only (their pages
are laid out alike; across tensor-parallel ranks the pieces would not line up with the heads a rank holds).

Ownership: an Export's pages stay allocated (the prefilled request's blocks, its running slots, plus the pinned
checkpoint's pages) until `release_export`. An Import's destination pages belong to the request, which the scheduler
holds in WAITING_FOR_TRANSFER from `begin_import` until `complete_import` (they become its running caches),
`abort_import`, or the engine ending it (`EngineCore.finish`: abort, deadline, error), which asks
`EngineCore.transfer_canceller` whether a READ may still land and frees or quarantines the pages accordingly.
After `run_unconfirmed` the pages are the running request's; the scheduler keeps the Import in `unconfirmed`
(its checkpoint reservation) until `confirm_import`, `refuse_unconfirmed` or the request's end.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hybridpd.engine.cache.coordinator import ReservedCheckpoint
from hybridpd.engine.core import EngineCore
from hybridpd.engine.detokenizer import IncrementalDetokenizer
from hybridpd.engine.request import Request

FALLBACKS = ("recompute", "fail")


@dataclass(frozen=True)
class Checkpoint:
    """A cached state checkpoint: the state after `num_tokens` tokens (of every recurrent group), in k pages."""

    num_tokens: int
    pages: tuple[int, ...]


@dataclass(frozen=True)
class Export:
    """A prefilled request's caches, pinned for a consumer. Ids are the producer's."""

    request_id: str
    num_tokens: int
    """Tokens computed: the whole prompt (N); the consumer computes from the first output token on."""
    blocks: Mapping[int, tuple[int, ...]]
    """Attention group id -> block ids holding those tokens, in order."""
    state_slots: Mapping[int, int]
    """Recurrent group id -> slot holding the state after `num_tokens`."""
    checkpoint: Checkpoint | None
    """The last cached state checkpoint within the prompt (in every recurrent group), pinned too; None if none."""
    pinned: Mapping[int, tuple[int, ...]]
    """Group id -> every page the export holds (what a lease accounts for)."""


@dataclass(frozen=True)
class ImportSource:
    """Where the producer holds what the consumer wants (from the transfer params)."""

    num_tokens: int
    blocks: Mapping[int, Sequence[int]]
    """Attention group id -> the producer's block ids for those tokens, in order."""
    state_slots: Mapping[int, int]
    """Recurrent group id -> the producer's slot holding the state after `num_tokens`."""
    checkpoint: Checkpoint | None = None
    """The producer's last checkpoint within the prompt, if it offers one (its pages)."""


@dataclass(frozen=True)
class Import:
    """Pages to read, paired position by position: {group id: ids} on the source and here. Held by the scheduler
    (WAITING_FOR_TRANSFER) from `begin_import` until `complete_import`, `abort_import` or the request's end."""

    request_id: str
    num_tokens: int
    local_hit_tokens: int
    src_blocks: Mapping[int, tuple[int, ...]]
    dst_blocks: Mapping[int, tuple[int, ...]]
    src_state_slots: Mapping[int, tuple[int, ...]]
    """Recurrent group id -> (running state slot,) on the producer."""
    dst_state_slots: Mapping[int, tuple[int, ...]]
    checkpoint: ReservedCheckpoint | None
    """Our pages reserved for the producer's checkpoint, published on completion."""
    deadline: float | None = None
    """Engine clock (monotonic) time after which the engine gives up on it (`EngineCore.expire_imports`)."""
    fallback: str = "recompute"
    """What the engine does when it gives up: "recompute" here from token 0, or "fail" the request."""
    src_checkpoint_pages: tuple[int, ...] = ()
    """The producer's pages of the checkpoint pulled into `checkpoint.pages` (read as blocks: `read_blocks`)."""

    def read_blocks(self) -> tuple[dict[int, tuple[int, ...]], dict[int, tuple[int, ...]]]:
        """(source, destination) block ids per attention group: the request's blocks, then the checkpoint's pages
        (block j of every attention group is page j of the arena)."""
        theirs = self.src_checkpoint_pages
        ours = self.checkpoint.pages if self.checkpoint is not None and theirs else ()
        return ({g: (*ids, *theirs) for g, ids in self.src_blocks.items()},
                {g: (*ids, *ours) for g, ids in self.dst_blocks.items()})


# -- producer ------------------------------------------------------------------------------------------------------
def export_prefilled(core: EngineCore, req: Request) -> Export:
    """Pin a request that finished as "prefilled" (its blocks and running slots are still allocated) together with
    the checkpoint `offered_checkpoint` picks, and describe them."""
    cache, n = core.cache, req.num_computed_tokens
    found = offered_checkpoint(core, req, n) if checkpoints_travel(core) else None
    ckpt = None
    if found is not None:
        ckpt = Checkpoint(found[0], found[1])
        cache.pin_checkpoint(found[1])
    tables, slots = cache.seq_tables(req.request_id)
    blocks = {gid: ids[: -(-n // cache.block_size)] for gid, ids in tables}
    states = dict(slots)
    pinned = dict(cache.req_pages(req.request_id))
    for gid in cache.attention_groups if ckpt is not None else ():
        pinned[gid] = pinned[gid] + ckpt.pages  # type: ignore[union-attr]
    return Export(req.request_id, n, blocks, states, ckpt, pinned)


def checkpoints_travel(core: EngineCore) -> bool:
    """Whether this engine offers and takes checkpoints in a handoff: its pages are exactly its attention blocks
    (so reading block j of every attention group reads all of page j; every rank agrees, EngineCore._start). Across
    workers a checkpoint's pages line up only where both slice alike (equal TP sizes): the consumer's worker drops
    the offer otherwise (decode/consumer.py: source_of)."""
    return core.plan.arena is not None and core.plan.arena.pages_are_blocks


def offered_checkpoint(core: EngineCore, req: Request, n: int) -> tuple[int, tuple[int, ...]] | None:
    """The checkpoint an export offers: the deepest one within the first `n` tokens, except that the request's own
    prompt-end checkpoints (saved by this request past its hit; under "reuse" admission at the last block
    boundaries of what it computed) give way to a shallower one: they name this prompt alone, while the shallower
    one (the branch point or the hit) is where the next prompt sharing the prefix hits, on P as on the consumer
    that caches what it pulls. The prompt-end one is offered only when nothing shallower is cached (the first
    request of a prefix; an identical prompt hits it on P, so it is then the hit, and offered)."""
    cache = core.cache
    found = cache.find_checkpoint(req, n)
    if found is None or cache.admission.name != "reuse" or found[0] <= req.num_cached_tokens:
        return found
    bs = cache.block_size
    own = (n - 1) // bs * bs  # the shallower of the coordinator's prompt-end targets ("last" and the prompt end)
    if found[0] < own:
        return found
    return cache.find_checkpoint(req, own - 1) or found


def release_export(core: EngineCore, req: Request, exp: Export) -> None:
    """Unpin an export (its lease ended: committed, released or expired)."""
    core.scheduler.release(req)
    if exp.checkpoint is not None:
        core.cache.unpin_checkpoint(exp.checkpoint.pages)


def export_pages_needed(core: EngineCore, num_tokens: int) -> dict[int, int]:
    """Attention blocks (per attention group) an export of `num_tokens` tokens pins (admission control counts
    these)."""
    return {gid: -(-num_tokens // core.cache.block_size) for gid in core.cache.attention_groups}


def recurrent_group_ids(core: EngineCore) -> list[int]:
    """The recurrent groups' ids (what a transfer's state slots are keyed by)."""
    return list(core.cache.recurrent_groups)


def pool_totals(core: EngineCore) -> dict[int, tuple[str, int]]:
    """Group id -> (kind, pages in the pool)."""
    return {int(s["group_id"]): (str(s["kind"]), int(s["total"])) for s in core.cache.pool_stats()}  # type: ignore[call-overload]


# -- consumer ------------------------------------------------------------------------------------------------------
def first_token_problem(core: EngineCore, req: Request, token_id: int, resumed: Sequence[int] = ()) -> str | None:
    """Why `req` (new, no output yet) cannot continue from `token_id` as its first output token (and, resuming a
    request another decode worker lost, the output tokens `resumed` after it): outside the vocabulary, or the last of
    them already ends the request (whoever sampled it should have finished it then); None when it can. The colocated
    engine's stop check runs on a copy of the request, which is left untouched."""
    for tid in (token_id, *resumed):
        if not 0 <= tid < core.vocab_size:
            return f"output token id {tid} is outside the vocabulary [0, {core.vocab_size})"
    outputs = [int(token_id), *(int(t) for t in resumed)]
    probe = dataclasses.replace(
        req,
        output_token_ids=outputs,
        output_logprobs=[0.0] * len(outputs),
        output_top_logprobs=[],
        detokenizer=None,
        stop_reason=None,
        stop_text_end=None,
    )
    reason = core.check_stop(probe)
    if reason is not None:
        return f"the output so far ends the request ({reason}): nothing is left to decode"
    return None


def add_first_token(
    core: EngineCore,
    req: Request,
    token_id: int,
    logprob: float,
    top_logprobs: Sequence[tuple[int, float]] = (),
    resumed: Sequence[int] = (),
) -> None:
    """Make `req` continue from the first output token the producer sampled (checked by `first_token_problem`):
    it becomes the request's first output, so penalties, min_tokens and the structured-output matcher (rebuilt by
    replaying the output) count it, and a seeded generator starts past its draw. The request then computes that
    token's KV first (after an import of the prompt, or with the prompt when it computes the prompt itself). Call
    after `begin_import` / `schedule_local` (so the import's prefix lookup counts the prompt alone) and before the
    next step; a request already ended (a refused transfer under policy "fail") is left as it is.
    `resumed`: the output tokens after the first that a lost decode worker had already streamed; they are added the
    same way (their logprobs, never sent again, are recorded as 0) and the request continues after the last."""
    if req.is_finished:
        return
    if (
        req.output_token_ids
        or req.num_computed_tokens
        or req.request_id in (r.request_id for r in core.scheduler.running)
    ):
        raise ValueError(f"request {req.request_id!r} already has output or computed tokens")
    req.output_token_ids.append(int(token_id))
    req.output_logprobs.append(float(logprob))
    if req.sampling_params.top_logprobs > 0:
        req.output_top_logprobs.append([(int(t), float(lp)) for t, lp in top_logprobs])
    for tid in resumed:
        req.output_token_ids.append(int(tid))
        req.output_logprobs.append(0.0)
        if req.sampling_params.top_logprobs > 0:
            req.output_top_logprobs.append([])
    core.runner.sampler.skip_samples(req.request_id, req.sampling_params, 1 + len(resumed))
    if resumed and core.tokenizer is not None:
        # the text as the lost worker made it, one token a step: where a character is split over tokens (or bytes
        # are no valid UTF-8) what a detokenizer holds back depends on how the tokens came
        detok = IncrementalDetokenizer(core.tokenizer, req.sampling_params.skip_special_tokens)
        for n in range(1, len(req.output_token_ids) + 1):
            detok.update(req.output_token_ids[:n])
        req.detokenizer = detok


def begin_import(
    core: EngineCore, req: Request, src: ImportSource, deadline: float | None = None, fallback: str = "recompute"
) -> Import | None:
    """Allocate what `req` needs to receive the producer's first `src.num_tokens` tokens, keeping our own prefix
    hit (attention blocks only: the running states come from the producer), and hold the request in the scheduler
    (WAITING_FOR_TRANSFER) with those pages. None when the pools cannot hold it now (nothing held, not scheduled).
    Raises ValueError (nothing kept allocated) when the source does not name exactly the pages needed."""
    if fallback not in FALLBACKS:
        raise ValueError(f"fallback must be one of {FALLBACKS}, got {fallback!r}")
    if req.request_id in core.scheduler.requests:
        raise ValueError(f"request id {req.request_id!r} is already scheduled")
    cache = core.cache
    alloc = cache.allocate_for_transfer(req, src.num_tokens)
    if alloc is None:
        return None
    src_blocks: dict[int, tuple[int, ...]] = {}
    src_states: dict[int, tuple[int, ...]] = {}
    dst_states: dict[int, tuple[int, ...]] = {}
    for gid, dst in alloc.block_ids.items():
        wanted = tuple(int(b) for b in src.blocks.get(gid, ()))[alloc.first_block_index :]
        if len(wanted) != len(dst):
            cache.free(req)
            raise ValueError(f"transfer source names {len(wanted)} blocks of group {gid}, expected {len(dst)}")
        src_blocks[gid] = wanted
    for gid in alloc.state_slots:
        if src.state_slots.get(gid) is None:
            cache.free(req)
            raise ValueError(f"transfer source names no state slot of recurrent group {gid}")
        src_states[gid] = (int(src.state_slots[gid]),)
    for gid, slot in alloc.state_slots.items():
        dst_states[gid] = (slot,)
    ckpt, theirs = None, ()
    offer = src.checkpoint
    if (offer is not None and 0 < offer.num_tokens <= src.num_tokens and len(offer.pages) == cache.k
            and checkpoints_travel(core)):
        # pulled whenever we do not cache it yet (reserve_checkpoint: None if cached), even within our own block
        # hit: that hit needs no checkpoint, but a prompt that branches there later restores from one
        ckpt = cache.reserve_checkpoint(req, offer.num_tokens)
        theirs = tuple(int(p) for p in offer.pages) if ckpt is not None else ()
    settle_device(core)
    imp = Import(
        req.request_id,
        src.num_tokens,
        alloc.local_hit_tokens,
        src_blocks,
        {gid: tuple(ids) for gid, ids in alloc.block_ids.items()},
        src_states,
        dst_states,
        ckpt,
        deadline,
        fallback,
        theirs,
    )
    core.scheduler.add_importing(req, imp)
    return imp


def settle_device(core: EngineCore) -> None:
    """Wait until every rank's device ran what was launched, when a step nobody waited for may still be queued
    (`ModelRunner.unwaited`): pages about to be written by a READ outside the stream may have been taken (evicted)
    from a checkpoint that step restores or saves, or blocks its forward writes."""
    runner = core.runner
    if not getattr(runner, "unwaited", False):  # (a stand-in runner without a device)
        return
    on_all = getattr(runner, "on_all", None)  # tensor parallel (engine.parallel.executor.LeaderRunner)
    if on_all is not None:
        from hybridpd.engine.runner import synchronize_rank

        on_all(synchronize_rank)
    else:
        runner.synchronize()
    runner.unwaited = False


def complete_import(core: EngineCore, req: Request, imp: Import | None = None) -> None:
    """The pulled pages are in place and confirmed: zero the untrusted tail of the last block, publish the blocks
    and the checkpoint in our prefix cache, and let the scheduler run the request from token `imp.num_tokens`."""
    imp = _take_pages(core, req)
    _publish(core, req, imp, imp.num_tokens)
    core.scheduler.transfer_done(req)


def run_unconfirmed(core: EngineCore, req: Request) -> None:
    """The pulled pages are in place but the producer has not confirmed them yet: let the request run from token
    `imp.num_tokens` at once (its Commit in flight meanwhile), its output from now on held back
    (`Request.held_from`: not streamed, its end deferred) and nothing of it published to the prefix cache, until
    `confirm_import` or `refuse_unconfirmed`."""
    _take_pages(core, req)
    req.held_from = len(req.output_token_ids)
    core.scheduler.hold_unconfirmed(req)


def confirm_import(core: EngineCore, req: Request) -> None:
    """The producer confirmed what `run_unconfirmed` ran on: publish the pulled blocks (and the ones filled since,
    as far as the request still holds them) and the checkpoint, release the held output, and end the request if it
    reached its end meanwhile. The caller streams the released output."""
    sched = core.scheduler
    imp = sched.confirm(req)
    _publish(core, req, imp, req.num_computed_tokens)  # 0 when preempted since (it holds nothing then)
    end = req.held_finish
    req.held_from = req.held_finish = None
    if req.request_id in sched.parked:
        core.finish(req, end or "stop")


def refuse_unconfirmed(core: EngineCore, req: Request, fallback: str, reason: str) -> None:
    """The producer refused what `run_unconfirmed` ran on (or could not be asked): drop the held output and
    everything computed (the pages go back unpublished; no READ is in flight), then compute from token 0 here
    ("recompute": the prompt and the producer's first token, as when a pull fails) or end the request ("fail")."""
    core.drop_held_output(req)
    imp = core.scheduler.restart(req)
    if imp is not None and imp.checkpoint is not None:
        core.cache.drop_checkpoint(imp.checkpoint)
    req.num_cached_tokens, req.external_computed_tokens = -1, 0
    if fallback == "fail":
        req.stop_reason = reason
        core.finish(req, "error", free_caches=False)  # `restart` freed them


def _take_pages(core: EngineCore, req: Request) -> Import:
    """Zero the untrusted tail of each group's last pulled block and count the request's tokens as computed."""
    imp = core.scheduler.importing[req.request_id]
    n = imp.num_tokens
    tail = n % core.cache.block_size
    for gid, ids in imp.dst_blocks.items():
        if tail and ids:
            core.runner.zero_block_tail(ids[-1], tail, gid)  # each group's own last block (its ids differ)
    req.num_computed_tokens = n
    req.num_cached_tokens = n
    req.external_computed_tokens = n - imp.local_hit_tokens
    return imp


def _publish(core: EngineCore, req: Request, imp: Import, num_tokens: int) -> None:
    cache = core.cache
    if num_tokens:
        cache.publish_transferred(req, num_tokens)
    if imp.checkpoint is not None:
        cache.publish_checkpoint(imp.checkpoint)
    cache.count_external(req, req.external_computed_tokens)


def abort_import(core: EngineCore, req: Request, imp: Import | None, reusable: bool) -> bool:
    """Let an importing request go unscheduled, its pages given back unpublished. `reusable` False: a READ may
    still write them, so they are quarantined instead (kept out of use for good; the request holds nothing and may
    compute afresh). Returns whether they were freed. The caller then calls `schedule_local` or `end_unscheduled`."""
    held = core.scheduler.drop_import(req)
    return core.drop_import_pages(req, held, reusable)


def schedule_local(core: EngineCore, req: Request) -> None:
    """Compute the whole prompt here (colocated, or a refused/failed transfer)."""
    req.num_computed_tokens = 0
    core.scheduler.add_request(req)


def end_unscheduled(core: EngineCore, req: Request, finish_reason: str, stop_reason: str | None = None) -> None:
    """End a request that is not scheduled (refused, or let go by `abort_import`): "error" or "abort"."""
    req.stop_reason = stop_reason
    core.finish(req, finish_reason, free_caches=False)
