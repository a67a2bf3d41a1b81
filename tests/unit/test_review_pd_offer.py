"""Review of `Offer.allows` (kvtransfer/lease.py) with a checkpoint read as extra blocks of every attention group:
against a plain statement of what an offer allows, over random offers and random (mostly wrong) reads."""

from __future__ import annotations

import itertools
import random

from hybridpd.kvtransfer.lease import Offer


def _allowed(offer: Offer, read: dict[int, tuple[int, ...]]) -> bool:
    """Every group read is the offer's (no other group); each recurrent group its running slot exactly; each
    attention group a suffix of its offered blocks, followed by the whole checkpoint in every attention group or in
    none."""
    if not set(read) <= set(offer.blocks) | set(offer.states):
        return False
    if any(read.get(g, ()) != s for g, s in offer.states.items()):
        return False
    for take in ((False, True) if offer.checkpoint else (False,)):
        tail = offer.checkpoint if take else ()
        if all(any(read.get(g, ()) == (*ids[len(ids) - m:], *tail) for m in range(len(ids) + 1))
               for g, ids in offer.blocks.items()):
            return True
    return False


def _offer(rng: random.Random) -> Offer:
    pages = rng.sample(range(1, 30), 12)
    n_blocks, k = rng.randrange(1, 5), rng.choice([0, 1, 2, 3])
    blocks, ckpt = tuple(pages[:n_blocks]), tuple(pages[n_blocks:n_blocks + k])
    groups = rng.choice([[0], [0, 2], [1, 3]])
    states = {g: (rng.randrange(1, 8),) for g in rng.choice([[], [5], [5, 6]])}
    return Offer({g: blocks for g in groups}, states, ckpt)


def _read(rng: random.Random, offer: Offer) -> dict[int, tuple[int, ...]]:
    read: dict[int, tuple[int, ...]] = {}
    take = bool(offer.checkpoint) and rng.random() < 0.6
    for g, ids in offer.blocks.items():
        r = rng.random()
        m = rng.randrange(len(ids) + 1)
        got = (*ids[len(ids) - m:], *(offer.checkpoint if take else ()))
        if r < 0.1:
            got = got[:-1]
        elif r < 0.2:
            got = (*got, rng.randrange(30))
        elif r < 0.25:
            got = tuple(rng.sample(got, len(got)))
        elif r < 0.3 and offer.checkpoint:
            got = (*ids[len(ids) - m:], *offer.checkpoint[::-1])
        elif r < 0.35:
            got = (*offer.checkpoint, *ids[len(ids) - m:])
        if rng.random() < 0.95:
            read[g] = got
    for g, s in offer.states.items():
        if rng.random() < 0.95:
            read[g] = s if rng.random() < 0.9 else (s[0] + 1,)
    if rng.random() < 0.05:
        read[9] = (1,)
    return read


def test_allows_is_exactly_the_offer() -> None:
    rng = random.Random(0)
    seen = {True: 0, False: 0}
    for _ in range(20000):
        offer = _offer(rng)
        read = _read(rng, offer)
        want = _allowed(offer, read)
        assert offer.allows(read) == want, (offer, read)
        seen[want] += 1
    assert min(seen.values()) > 2000


def test_checkpoint_pages_only_in_every_group_or_none() -> None:
    offer = Offer({0: (4, 5), 1: (4, 5)}, {2: (3,)}, (7, 8))
    for a, b in itertools.product([(), (5,), (4, 5)], repeat=2):
        assert offer.allows({0: (*a, 7, 8), 1: (*b, 7, 8), 2: (3,)})
        assert offer.allows({0: a, 1: b, 2: (3,)})
        assert not offer.allows({0: (*a, 7, 8), 1: b, 2: (3,)})
        assert not offer.allows({0: (*a, 7), 1: (*b, 7), 2: (3,)})
