"""Applying BPE merges to one pre-token's ids, and the tables and cache that make it fast.

`merge_table` turns the merges, in creation order, into `(left id, right id) -> (rank, merged id)`. `merge_ids`
then repeatedly merges the adjacent pair of lowest rank, leftmost first, until no pair is a merge: on a short
pre-token by rescanning a list of candidates (C-level `min` and `index`), on a long one with a heap
(`_merge_long`), which is O(n log n) where the rescan would be quadratic. `BoundedCache` keeps the ids of
recent pre-tokens, so repeated words cost one dict lookup.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from scratchlm.console import console
from scratchlm.errors import ScratchlmError
from scratchlm.tokenizer.options import EncodingOptions


def index_vocabulary(
    vocab: dict[int, bytes], special_tokens: list[str]
) -> tuple[dict[bytes, int], dict[str, int]]:
    """Token -> id, and special token -> id, adding to `vocab` (in place) each special token it lacks, with
    the next free id; a token that two ids share, or an empty special token, is refused."""
    token_ids: dict[bytes, int] = {}
    for token_id, token in sorted(vocab.items()):
        if token in token_ids:
            raise ScratchlmError(
                f"vocabulary ids {token_ids[token]} and {token_id} are both the token {token!r}"
            )
        token_ids[token] = token_id
    special_ids: dict[str, int] = {}
    for special in special_tokens:
        if not special:
            raise ScratchlmError("a special token cannot be the empty string")
        token = special.encode("utf-8")
        if token not in token_ids:
            new_id = max(vocab, default=-1) + 1
            vocab[new_id] = token
            token_ids[token] = new_id
        special_ids[special] = token_ids[token]
    return token_ids, special_ids


def merge_table(
    merges: list[tuple[bytes, bytes]], token_ids: dict[bytes, int]
) -> dict[tuple[int, int], tuple[int, int]]:
    """(left id, right id) -> (rank, merged id). The lowest rank is the earliest merge; a pair listed twice
    keeps its first rank. Each merge may only join tokens that exist by then (bytes or earlier merges), as
    training makes them: this is what makes "apply the merges in creation order" and "repeatedly merge the
    lowest-ranked pair" the same thing."""
    table: dict[tuple[int, int], tuple[int, int]] = {}
    made = {bytes([b]) for b in range(256)}
    for rank, (left, right) in enumerate(merges):
        for part in (left, right):
            if part not in made:
                raise ScratchlmError(
                    f"merge {rank} ({left!r}, {right!r}): {part!r} is neither a byte nor made by an earlier merge"
                )
        made.add(left + right)
        ids = []
        for part in (left, right, left + right):
            if part not in token_ids:
                raise ScratchlmError(
                    f"merge {rank} ({left!r}, {right!r}): the token {part!r} is not in the vocabulary"
                )
            ids.append(token_ids[part])
        table.setdefault((ids[0], ids[1]), (rank, ids[2]))
    return table


class PretokenMerger:
    """The ids of one pre-token (called with it): its UTF-8 bytes merged by `merge_ids`; with the option
    `ignore_merges`, the pre-token's own id when it is a token. A vocabulary may lack single-byte tokens only
    with `drop_missing_bytes`, and those bytes are then left out before merging, as `tokenizers` leaves out a
    character it has no token for when there is no unknown token (the bytes around it may then merge)."""

    def __init__(
        self, token_ids: dict[bytes, int], merges: list[tuple[bytes, bytes]], options: EncodingOptions
    ) -> None:
        missing = [b for b in range(256) if bytes([b]) not in token_ids]
        if missing and not options.drop_missing_bytes:
            raise ScratchlmError(
                f"the vocabulary lacks {len(missing)} single-byte tokens (first: {bytes(missing[:1])!r});"
                " a byte-level vocabulary needs all 256"
            )
        self._token_ids = token_ids
        self._byte_ids = [token_ids.get(bytes([b]), -1) for b in range(256)]  # -1: no token, dropped
        self._merges = merge_table(merges, token_ids)
        self._whole = options.ignore_merges
        self._drop = bool(missing)
        self._dropped_said = False

    def __call__(self, pretoken: str) -> tuple[int, ...]:
        try:
            data = pretoken.encode("utf-8")
        except UnicodeEncodeError:
            # Lone surrogates have no UTF-8 form; like tiktoken, read them as U+FFFD (pairs become one character).
            data = pretoken.encode("utf-16", "surrogatepass").decode("utf-16", "replace").encode("utf-8")
        if self._whole and data in self._token_ids:
            return (self._token_ids[data],)
        ids = [self._byte_ids[b] for b in data]
        if self._drop and -1 in ids:
            ids = [token_id for token_id in ids if token_id >= 0]
            if not self._dropped_said:
                self._dropped_said = True
                byte = next(bytes([b]) for b in data if self._byte_ids[b] < 0)
                console.print(
                    f"note: the vocabulary has no token for byte {byte!r}; such bytes are left out of the ids, "
                    "as HF tokenizers leaves them out"
                )
        return merge_ids(ids, self._merges)


def merge_ids(ids: list[int], merges: dict[tuple[int, int], tuple[int, int]]) -> tuple[int, ...]:
    """The ids of one pre-token's bytes merged: repeatedly the adjacent pair with the lowest merge rank,
    leftmost first, until no adjacent pair is a merge."""
    if len(ids) > _LONG_PRETOKEN:
        return _merge_long(ids, merges)
    # candidates[k] is the (rank, merged id) of the pair ids[k], ids[k + 1], or _NO_MERGE. Finding the
    # smallest and its leftmost place is C-level work; after a merge only its two neighbours change.
    lookup = merges.get
    candidates = list(map(lookup, itertools.pairwise(ids), itertools.repeat(_NO_MERGE)))
    while candidates and (best := min(candidates)) is not _NO_MERGE:
        i = candidates.index(best)
        ids[i : i + 2] = (best[1],)
        del candidates[i]
        if i > 0:
            candidates[i - 1] = lookup((ids[i - 1], ids[i]), _NO_MERGE)
        if i < len(candidates):
            candidates[i] = lookup((ids[i], ids[i + 1]), _NO_MERGE)
    return tuple(ids)


_NO_MERGE = (float("inf"), -1)

# Pre-tokens longer than this (in bytes) are merged with a heap: the simple loop above rescans every pair after
# each merge, which is fastest for words but quadratic for, say, a megabyte-long run of letters.
_LONG_PRETOKEN = 128


def _merge_long(ids: list[int], merges: dict[tuple[int, int], tuple[int, int]]) -> tuple[int, ...]:
    """The same merges as `merge_ids`, in O(n log n): a heap of candidate pairs `(rank, position)` over a
    linked list of positions. An entry whose pair has changed since it was pushed is skipped when popped."""
    n = len(ids)
    following = list(range(1, n + 1))  # next live position (n = none)
    preceding = list(range(-1, n - 1))  # previous live position (-1 = none)
    heap = [(*merges[pair], i) for i, pair in enumerate(itertools.pairwise(ids)) if pair in merges]
    heapq.heapify(heap)
    while heap:
        rank, merged_id, i = heapq.heappop(heap)
        j = following[i]
        if j >= n or merges.get((ids[i], ids[j]), _NO_MERGE)[0] != rank:
            continue  # stale: one side of this pair has been merged away since
        ids[i] = merged_id
        ids[j] = -1
        following[i] = following[j]
        if following[j] < n:
            preceding[following[j]] = i
        for left, right in ((preceding[i], i), (i, following[i])):
            if left >= 0 and right < n and (pair := (ids[left], ids[right])) in merges:
                heapq.heappush(heap, (*merges[pair], left))
    return tuple(token for token in ids if token >= 0)


class BoundedCache(dict):
    """key -> compute(key), computed on first use. When full, the older half is dropped (dicts keep insertion
    order), so memory stays bounded while frequent keys come straight back."""

    def __init__(self, compute: Callable[[str], tuple[int, ...]], max_size: int) -> None:
        super().__init__()
        self._compute = compute
        self._max_size = max_size

    def __missing__(self, key: str) -> tuple[int, ...]:
        value = self._compute(key)
        if len(self) >= self._max_size:
            for old in list(itertools.islice(self, len(self) // 2)):
                del self[old]
        self[key] = value
        return value
