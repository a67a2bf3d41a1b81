"""What binds a transfer to one prompt, one lease and one cluster (pure functions, no NIXL, no torch).

    prompt_digest(tokens[:n], salt)  P puts it in TransferParams; D recomputes it from the request's own prompt and
                                     refuses params that disagree (before pulling), then presents its own digest to
                                     P's Commit, which compares it with what P really computed (before caching).
    new_lease_token()                random per lease: Commit and release notices must present it.
    membership_proof(token, ...)     HMAC answer to D's handshake nonce: a peer that cannot produce it does not
                                     hold the cluster token, and D does not pull from it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from array import array
from collections.abc import Sequence

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
