"""What D checks in transfer params before it pulls anything (step thread; tensor-free).

D cannot check P's MAC (the key never leaves P): P's Commit does, after the READ and before D uses a byte of it.
What D can check up front it does, so that malformed or altered params cost no READ: the params are signed at all,
name this prompt's length, exactly this model's groups, as many blocks per attention group as the tokens need, no
page twice, and a checkpoint that is consistent. The prompt digest and the lease's expiry are checked by the
consumer itself (decode/consumer.py)."""

from __future__ import annotations

from hybridpd.engine.core import EngineCore
from hybridpd.engine.request import Request
from hybridpd.engine.transfer import export_pages_needed, recurrent_group_ids
from hybridpd.kvtransfer.binding import MAC_BYTES
from hybridpd.proto import hybridpd_pb2 as pb


def _distinct(ids: list[int]) -> bool:
    return len(set(ids)) == len(ids) and all(i >= 0 for i in ids)


def params_problem(core: EngineCore, req: Request, tp: pb.TransferParams) -> str | None:
    """Why these params cannot be P's for `req` (a short phrase), or None when nothing visible from here is wrong."""
    n = int(tp.num_computed_tokens)
    if len(tp.mac) != MAC_BYTES:
        return "unsigned params"
    if tp.num_prompt_tokens != req.num_prompt_tokens:
        return f"params name a prompt of {tp.num_prompt_tokens} tokens, this one has {req.num_prompt_tokens}"
    need = export_pages_needed(core, n)
    named = [int(g.group_id) for g in tp.groups]
    if sorted(named) != sorted(need):
        return f"params name attention groups {named}, the model has {sorted(need)}"
    for g in tp.groups:
        ids = [int(b) for b in g.block_ids]
        if len(ids) != need[g.group_id] or not _distinct(ids):
            return f"group {g.group_id}: {len(ids)} block ids for {n} tokens (want {need[g.group_id]} distinct)"
    recurrent = sorted(recurrent_group_ids(core))
    states = [int(s.group_id) for s in tp.states]
    if sorted(states) != recurrent:
        return f"params name recurrent groups {states}, the model has {recurrent}"
    if any(int(s.state_slot) < 0 for s in tp.states):
        return "a recurrent group's state slot is negative"
    pages = [int(p) for p in tp.checkpoint_pages]
    if bool(pages) != (tp.checkpoint_num_tokens > 0) or (pages and not recurrent):
        return "a checkpoint named without its pages or its token count, or for a model without recurrent layers"
    blocks = {int(b) for g in tp.groups for b in g.block_ids}
    if pages and (not _distinct(pages) or min(pages) <= 0 or blocks & set(pages)):
        return "checkpoint pages that are not distinct pages apart from the blocks"
    if not 0 <= tp.checkpoint_num_tokens <= n:
        return f"checkpoint at {tp.checkpoint_num_tokens} tokens, past the {n} transferred"
    return None
