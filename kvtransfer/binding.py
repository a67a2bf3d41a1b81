"""What binds a transfer to one prompt, one lease and one cluster (pure functions, no NIXL, no torch).

    prompt_digest(tokens[:n], salt)  P puts it in TransferParams; D recomputes it from the request's own prompt and
                                     refuses params that disagree (before pulling), then presents its own digest to
                                     P's Commit, which compares it with what P really computed (before caching).
    new_lease_token()                random per lease: Commit and release notices must present it.
    membership_proof(token, ...)     HMAC answer to D's handshake nonce: a peer that cannot produce it does not
                                     hold the cluster token, and D does not pull from it.
    params_mac(key, request_id, tp)  HMAC-SHA256 of transfer params as P issued them, under a key only P holds
                                     (new_mac_key, one per P process): P's Commit refuses params whose mac is not
                                     right, so a caller holding the cluster token cannot make D read other pages
                                     (another prompt's blocks under this prompt's lease) and have them confirmed.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from array import array
from collections.abc import Sequence
from typing import Any

_DIGEST_SEED = b"hybridpd/transfer-binding/v1"


def prompt_digest(token_ids: Sequence[int], num_tokens: int, cache_salt: str | None = None) -> bytes:
    """sha256 over the salt, the count and the first `num_tokens` token ids (independent of block size)."""
    if not 0 <= num_tokens <= len(token_ids):
        raise ValueError(f"num_tokens {num_tokens} outside the prompt's {len(token_ids)} tokens")
    salt = (cache_salt or "").encode()
    h = hashlib.sha256(_DIGEST_SEED)
    h.update(len(salt).to_bytes(4, "little"))
    h.update(salt)
    h.update(num_tokens.to_bytes(8, "little"))
    h.update(array("q", token_ids[:num_tokens]).tobytes())
    return h.digest()


def new_lease_token() -> str:
    return secrets.token_hex(16)


def new_nonce() -> bytes:
    return secrets.token_bytes(16)


def membership_proof(cluster_token: str, nonce: bytes, worker_id: str, epoch: str, agent_metadata: bytes) -> bytes:
    msg = b"|".join((nonce, worker_id.encode(), epoch.encode(), hashlib.sha256(agent_metadata).digest()))
    return hmac.new(cluster_token.encode(), msg, hashlib.sha256).digest()


def verify_membership(cluster_token: str, nonce: bytes, worker_id: str, epoch: str, agent_metadata: bytes,
                      proof: bytes) -> bool:
    want = membership_proof(cluster_token, nonce, worker_id, epoch, agent_metadata)
    return hmac.compare_digest(want, proof)


MAC_KEY_BYTES = 32
MAC_BYTES = 32
_MAC_SEED = b"hybridpd/transfer-params/v3"


def new_mac_key() -> bytes:
    return secrets.token_bytes(MAC_KEY_BYTES)


def _str(value: str | bytes) -> bytes:
    raw = value.encode() if isinstance(value, str) else bytes(value)
    return struct.pack("<q", len(raw)) + raw


def _ints(values: Sequence[int]) -> bytes:
    return struct.pack("<q", len(values)) + array("q", values).tobytes()


def _canonical_params(request_id: str, tp: Any) -> bytes:
    """Every field of TransferParams but `mac`, in field order, each length-prefixed (repeated fields in the order
    they were sent: a reordered or duplicated group changes the bytes too)."""
    parts = [_MAC_SEED, _str(request_id), _str(tp.worker_id), _str(tp.epoch), _str(tp.prefill_address),
             struct.pack("<q", len(tp.groups))]
    parts += [struct.pack("<q", g.group_id) + _ints(list(g.block_ids)) for g in tp.groups]
    parts.append(struct.pack("<qqdq", tp.num_computed_tokens, tp.num_prompt_tokens, tp.lease_expiry_unix,
                             tp.checkpoint_num_tokens))
    parts += [_str(tp.lease_token), _str(tp.prompt_digest), struct.pack("<q", len(tp.states))]
    parts += [struct.pack("<qq", s.group_id, s.state_slot) for s in tp.states]
    parts.append(_ints(list(tp.checkpoint_pages)))
    return b"".join(parts)


def params_mac(key: bytes, request_id: str, tp: Any) -> bytes:
    """MAC of `tp` (a TransferParams) issued for `request_id`; its own `mac` field is not covered."""
    return hmac.new(key, _canonical_params(request_id, tp), hashlib.sha256).digest()


def verify_params_mac(key: bytes, request_id: str, tp: Any) -> bool:
    return len(tp.mac) == MAC_BYTES and hmac.compare_digest(params_mac(key, request_id, tp), tp.mac)
