"""Client API keys with per-key limits: the keys file and the lookup of a request's key.

Keys file (`--api-keys-file PATH`), one key per line, `#` starts a comment:

    # name     key                               limits (optional, else the command's defaults)
    alice      sk-alice-3f9c...                  max_concurrency=16 tokens_per_minute=200000
    batch-job  sk-batch-81aa...                  max_concurrency=64

`max_concurrency` bounds the key's sequences in flight (a request with `n` choices over `p` prompts holds n x p),
`tokens_per_minute` the prompt + max_tokens it may reserve per minute (unused max_tokens are given back). Both are
enforced by `proxy.admission`; 0 means unlimited. The name labels the key in logs and metrics (never the key).
A malformed line is an error naming the line (ValueError), never a silently ignored key.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from pathlib import Path

_LIMIT_FIELDS = ("max_concurrency", "tokens_per_minute")


@dataclass(frozen=True)
class ApiKey:
    """One client key. `max_concurrency` / `tokens_per_minute`: 0 = unlimited."""

    name: str
    key: str = field(repr=False)
    max_concurrency: int = 0
    tokens_per_minute: int = 0


def parse_keys(text: str, source: str = "keys file", max_concurrency: int = 0,
               tokens_per_minute: int = 0) -> tuple[ApiKey, ...]:
    """Parse a keys file's text; `max_concurrency` / `tokens_per_minute` are the defaults of lines without them."""
    keys: list[ApiKey] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        parts = raw.split("#", 1)[0].split()
        if not parts:
            continue
        if len(parts) < 2:
            raise ValueError(f"{source} line {number}: expected 'NAME KEY [max_concurrency=N] [tokens_per_minute=N]'")
        limits = {"max_concurrency": max_concurrency, "tokens_per_minute": tokens_per_minute}
        for item in parts[2:]:
            name, _, value = item.partition("=")
            if name not in _LIMIT_FIELDS or not value.isdigit():
                raise ValueError(f"{source} line {number}: unknown or malformed limit {item[:40]!r} (expected "
                                 f"{' or '.join(f'{f}=N' for f in _LIMIT_FIELDS)})")
            limits[name] = int(value)
        keys.append(ApiKey(parts[0], parts[1], **limits))
    _check_unique(keys, source)
    return tuple(keys)


def _check_unique(keys: list[ApiKey], source: str) -> None:
    names = [k.name for k in keys]
    values = [k.key for k in keys]
    if len(set(names)) != len(names) or len(set(values)) != len(values):
        raise ValueError(f"{source}: every key needs a unique name and a unique value")


def load_keys_file(path: str, max_concurrency: int = 0, tokens_per_minute: int = 0) -> tuple[ApiKey, ...]:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"cannot read the API keys file {path}: {e.strerror or e}") from None
    keys = parse_keys(text, f"API keys file {path}", max_concurrency, tokens_per_minute)
    if not keys:
        raise ValueError(f"the API keys file {path} holds no key")
    return keys


def find_key(keys: tuple[ApiKey, ...], presented: str) -> ApiKey | None:
    """The key whose value equals `presented` (constant-time per comparison; every key is compared)."""
    found = None
    token = presented.encode()
    for k in keys:
        if secrets.compare_digest(token, k.key.encode()):
            found = k
    return found
