"""proto <-> engine conversions (one place)."""

from __future__ import annotations

from hybridpd.engine.async_engine import OutputDelta
from hybridpd.engine.core import EngineCore
from hybridpd.engine.prompt_logprobs import PromptLogprobs
from hybridpd.engine.sampling_params import SamplingParams
from hybridpd.engine.structured.spec import StructuredOutput
from hybridpd.proto import hybridpd_pb2 as pb


def sampling_params_from_proto(p: pb.SamplingParams) -> SamplingParams:
    """Raises InvalidRequestError (-> INVALID_ARGUMENT) on bad values."""
    return SamplingParams(
        max_tokens=int(p.max_tokens),
        temperature=float(p.temperature) if p.HasField("temperature") else 1.0,
        top_p=float(p.top_p) if p.HasField("top_p") else 1.0,
        top_k=max(0, int(p.top_k)) if p.HasField("top_k") else 0,
        seed=int(p.seed) if p.HasField("seed") else None,
        stop=tuple(p.stop),
        stop_token_ids=tuple(int(t) for t in p.stop_token_ids),
        ignore_eos=bool(p.ignore_eos),
        presence_penalty=float(p.presence_penalty),
        frequency_penalty=float(p.frequency_penalty),
        repetition_penalty=float(p.repetition_penalty) if p.HasField("repetition_penalty") else 1.0,
        min_tokens=int(p.min_tokens),
        logit_bias={int(k): float(v) for k, v in p.logit_bias.items()} or None,
        include_stop_str_in_output=bool(p.include_stop_str_in_output),
        top_logprobs=int(p.top_logprobs) if p.logprobs else 0,
        structured_output=(StructuredOutput(p.structured_output.kind, p.structured_output.spec)
                           if p.HasField("structured_output") else None),
        min_p=float(p.min_p),
        allowed_token_ids=tuple(int(t) for t in p.allowed_token_ids) or None,
        bad_words=tuple(p.bad_words),
        skip_special_tokens=p.skip_special_tokens if p.HasField("skip_special_tokens") else True,
        prompt_logprobs=int(p.prompt_logprobs) if p.HasField("prompt_logprobs") else None,
    )


def stats_response(core: EngineCore, role: str, worker_id: str, epoch: str, metrics_port: int,
                   pinned: dict[int, int] | None = None, leases: int = 0, extra_waiting: int = 0,
                   max_generate: int | None = None) -> pb.StatsResponse:
    """Step thread only (reads the pools). `max_generate`: whole requests the worker takes at once (None: its
    max_num_seqs, as a decode worker)."""
    pools = [
        pb.PoolStats(
            group_id=int(s["group_id"]), kind=str(s["kind"]), total=int(s["total"]), free=int(s["free"]),  # type: ignore[call-overload]
            cached=int(s["cached"]), in_use=int(s["in_use"]),  # type: ignore[call-overload]
            pinned=(pinned or {}).get(int(s["group_id"]), 0), integrity_ok=bool(s["integrity_ok"]),  # type: ignore[call-overload]
        )
        for s in core.pool_health()
    ]
    running, waiting = core.queue_lengths()
    memory = {k: int(v) for k, v in core.kv_cache_info().items() if k.endswith(("_bytes", "_bytes_in_use",
                                                                                "_bytes_cached", "_bytes_held"))}
    return pb.StatsResponse(
        role=role, worker_id=worker_id, epoch=epoch, num_running=running, num_waiting=waiting + extra_waiting,
        pools=pools, leases_pinned=leases, metrics_port=metrics_port, memory_bytes=memory,
        max_num_seqs=core.config.scheduler.max_num_seqs,
        max_generate=core.config.scheduler.max_num_seqs if max_generate is None else max_generate,
    )


def chunk_of(delta: OutputDelta, text: str, want_logprobs: bool) -> pb.GenerateChunk:
    """One stream message: the delta's tokens (and logprobs when asked), `text` the part of its text that may go
    out now."""
    chunk = pb.GenerateChunk(
        token_ids=delta.token_ids,
        text=text,
        logprobs=delta.logprobs if want_logprobs else (),
        top_logprobs=[
            pb.TopLogprobs(token_ids=[t for t, _ in top], logprobs=[lp for _, lp in top]) for top in delta.top_logprobs
        ]
        if want_logprobs
        else [],
        finish_reason=delta.finish_reason or "",
        num_prompt_tokens=delta.num_prompt_tokens,
        num_cached_tokens=delta.num_cached_tokens,
        num_external_cached_tokens=delta.num_external_tokens,
    )
    set_stop_match(chunk, delta.stop_match)
    if delta.prompt_logprobs is not None:
        set_prompt_logprobs(chunk, delta.prompt_logprobs)
    return chunk


def set_prompt_logprobs(chunk: pb.GenerateChunk, scores: PromptLogprobs) -> None:
    """`chunk.prompt_logprobs`: one entry per scored prompt token (engine.prompt_logprobs)."""
    chunk.prompt_logprobs.extend(
        pb.PromptLogprob(token_id=t, logprob=lp, rank=r, top=pb.TopLogprobs(token_ids=ids, logprobs=lps))
        for t, lp, r, ids, lps in zip(scores.token_ids, scores.logprobs, scores.ranks, scores.top_ids,
                                      scores.top_logprobs, strict=True))


def set_stop_match(chunk: pb.GenerateChunk, match: str | int | None) -> None:
    """`chunk.stop_string` / `stop_token_id`: what ended the request with "stop" (`EngineCore.stop_match`)."""
    if isinstance(match, str):
        chunk.stop_string = match
    elif match is not None:
        chunk.stop_token_id = match
