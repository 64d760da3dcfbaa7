"""Learning BPE merges from counted pre-tokens: the second phase of training (the first, counting, is in `train`).

Each distinct pre-token becomes a "word", weighted by its count: training only ever looks at words times their
counts, so a 2 GB corpus becomes a few hundred thousand short words. Then, `num_merges` times: find the most
frequent adjacent pair of tokens `(a, b)`, counted inside words and weighted by their counts (ties go to the
lexicographically greater pair of byte strings, the rule of the CS336 assignment-1 handout), give `a + b` the next
id, and replace every occurrence of `a b`, from left to right, by it (`a a a` becomes `ab a`).

Recounting every pair after every merge would cost the whole corpus each time. Instead we keep
  - `pair_counts[(a, b)]`: how often `a` is followed by `b`, over all words times their counts;
  - `pair_places[(a, b)]`: where the pair occurs (see below), so that a merge visits only those places. It may
    still name places that have lost the pair: they are skipped when the pair is merged, which is cheaper than
    removing them whenever a pair disappears;
  - a heap of `(-count, key, pair)` giving the most frequent pair, ties going to the greater pair of bytes.
    `heapq` is a min-heap, so `key` orders pairs in reverse: each byte x becomes the character 255 - x and each
    token of the pair ends with the character 256, which sorts after every byte, so that a longer token with
    the same prefix comes first, as it must.
A merge of `(a, b)` into the new token `t` turns each occurrence `x a b y` into `x t y`: the counts of `(x, a)` and
`(b, y)` go down, `(x, t)` and `(t, y)` appear (and `a b a b` gives `(t, t)` for a lost `(b, a)`). Counts of
existing pairs only ever go down (every new pair contains the new token), so the heap needs no decrease-key: an
entry whose count is stale is an upper bound, and when it reaches the top it is pushed back with its current
count. An entry that reaches the top with its true count is then the true maximum.

All words live in one array of token ids, `Words.tokens`, each followed by a separator (-1), and a place is the
index of a pair's first token there. Merging writes `t` over `a` and a hole (-2) over `b`, so places never move;
the links `next` and `prev` step over the holes to the neighbouring tokens. That lets a merge be done either way:
  - with few places (most merges: rare pairs), one by one in Python, through `array` views of the arrays;
  - with many (the first merges, which visit most of the corpus: on text with many distinct words, prose or
    other languages than English, millions of places in all), all at once with numpy: gather the tokens at the
    places, keep the real occurrences, write the new token and the links, read the neighbours, and add up the
    counts of the new pairs by neighbour after one sort.
Both give the same pairs, counts and places; the tests run each way alone against a brute-force trainer.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Callable, Iterable, Mapping
from itertools import pairwise

import numpy as np

# A merge with fewer places than this is done in Python, one place at a time; with more, in numpy, whose few
# dozen calls per merge cost as much as visiting about this many places in Python.
FEW_PLACES = 128

_SEPARATOR, _HOLE = -1, -2

Pair = tuple[int, int]
# A pair that a merge makes appear: (the new pair, the pair it replaces, its count, its places).
Appeared = tuple[Pair, Pair, int, "list[int] | np.ndarray"]


def learn_merges(
    pretoken_counts: Mapping[bytes, int],
    num_merges: int,
    on_merge: Callable[[int, int], None] | None = None,
) -> list[tuple[bytes, bytes]]:
    """Up to `num_merges` BPE merges learned from pre-tokens (byte strings) and their counts.

    Each step merges the most frequent adjacent pair of tokens, counted inside pre-tokens and weighted by their
    counts, ties going to the lexicographically greater pair of byte strings. Stops early when no pair is left.
    `on_merge(done, total)` is called now and then.
    """
    tokens: list[bytes] = [bytes([i]) for i in range(256)]
    # Reverse-order sort key of each token (see module docstring): key(a) < key(b) iff a > b as byte strings.
    keys: list[str] = [chr(255 - i) + "\u0100" for i in range(256)]
    words = Words([(w, n) for w, n in pretoken_counts.items() if len(w) > 1 and n > 0])
    pair_places: dict[Pair, list[int] | np.ndarray] = {}
    pair_counts: dict[Pair, int] = {}
    for code, count, places in words.initial_pairs():
        pair = divmod(code, 256)
        pair_places[pair], pair_counts[pair] = places, count
    heap = [(-count, keys[a] + keys[b], (a, b)) for (a, b), count in pair_counts.items()]
    heapq.heapify(heap)

    merges: list[tuple[bytes, bytes]] = []
    report_every = max(1, num_merges // 200)
    while len(merges) < num_merges and heap:
        negative_count, key, pair = heapq.heappop(heap)
        count = pair_counts.get(pair, 0)
        if count != -negative_count:  # stale: the pair lost occurrences since this entry was pushed
            if count > 0:
                heapq.heappush(heap, (-count, key, pair))
            continue

        a, b = pair
        new = len(tokens)
        tokens.append(tokens[a] + tokens[b])
        keys.append(keys[a][:-1] + keys[b])
        merges.append((tokens[a], tokens[b]))
        places = pair_places.pop(pair)
        merge = words.merge_few if len(places) < FEW_PLACES else words.merge_many
        for new_pair, lost_pair, count, new_places in merge(pair, new, places):
            pair_counts[lost_pair] -= count
            if not pair_counts[lost_pair]:  # gone for good: only pairs with the new token ever appear
                del pair_counts[lost_pair]
                pair_places.pop(lost_pair, None)
            pair_counts[new_pair] = count
            pair_places[new_pair] = new_places
            heapq.heappush(heap, (-count, keys[new_pair[0]] + keys[new_pair[1]], new_pair))
        pair_counts.pop(pair, None)
        if on_merge and len(merges) % report_every == 0:
            on_merge(len(merges), num_merges)
    if on_merge:
        on_merge(len(merges), num_merges)
    return merges


class Words:
    """The words as one array of token ids with links between neighbouring tokens (see the module docstring).

    Each array has a numpy view, for merges done all at once, and an `array` view of the same memory, whose
    items Python reads and writes quickly, for merges done one place at a time.
    """

    def __init__(self, words: list[tuple[bytes, int]]) -> None:
        lengths = np.fromiter((len(w) for w, _ in words), dtype=np.int64, count=len(words))
        size = int(lengths.sum()) + len(words) + 2  # a separator first, and after every word
        # 32-bit places and token ids unless the words are too long for them.
        kind = ("i", np.int32) if size < 2**31 else ("q", np.int64)
        self.tokens_, self.tokens = _shared(kind, size, _SEPARATOR)
        is_byte = np.ones(size - 2, dtype=bool)
        is_byte[np.cumsum(lengths + 1) - 1] = False
        self.tokens[1:-1][is_byte] = np.frombuffer(b"".join(w for w, _ in words), dtype=np.uint8)
        # The count of the word each token is in.
        self.weights_, self.weights = _shared(("q", np.int64), size, 0)
        counts = np.fromiter((n for _, n in words), dtype=np.int64, count=len(words))
        self.weights[1:-1] = np.repeat(counts, lengths + 1)
        self.next_, self.next = _shared(kind, size, 0)
        self.next[:] = np.arange(1, size + 1)
        self.next[-1] = size - 1
        self.prev_, self.prev = _shared(kind, size, 0)
        self.prev[:] = np.arange(-1, size - 1)
        self.prev[0] = 0

    def initial_pairs(self) -> Iterable[tuple[int, int, list[int] | np.ndarray]]:
        """`(256 * a + b, count, places)` for each pair of bytes that occurs."""
        tokens = self.tokens
        places = np.flatnonzero((tokens[:-1] >= 0) & (tokens[1:] >= 0)).astype(tokens.dtype)
        # 16 bits, which numpy's stable sort sorts by radix, in linear time.
        codes = (tokens[places] * 256 + tokens[places + 1]).astype(np.uint16)
        return _by_key(codes, places, self.weights[places])

    def merge_few(self, pair: Pair, new: int, places: list[int] | np.ndarray) -> list[Appeared]:
        """Merge `pair` into `new` at those of `places` where it still occurs, in Python; the pairs that appear."""
        tokens, next_, prev, weights = self.tokens_, self.next_, self.prev_, self.weights_
        a, b = pair
        if not isinstance(places, list):
            places = places.tolist()
        if a == b:  # left to right, so that of overlapping occurrences (`a a a`) the first is merged
            places.sort()
        merged = []
        for i in places:
            if tokens[i] == a:  # not if stale, nor a hole: the second `a` of `a a a` once the first is merged
                j = next_[i]
                if tokens[j] == b:
                    k = next_[j]
                    tokens[i], tokens[j], next_[i], prev[k] = new, _HOLE, k, i
                    merged.append(i)
        # The neighbours once every occurrence is merged, so that `a b a b` gives `(new, new)` once.
        left: dict[int, list] = {}  # x -> [count, places] of `(x, new)`, x = new included
        right: dict[int, list] = {}  # y -> [count, places] of `(new, y)`, y = new left to `left`
        for i in merged:
            weight = weights[i]
            h = prev[i]
            x = tokens[h]
            if x >= 0:
                if x in left:
                    left[x][0] += weight
                    left[x][1].append(h)
                else:
                    left[x] = [weight, [h]]
            y = tokens[next_[i]]
            if y >= 0 and y != new:
                if y in right:
                    right[y][0] += weight
                    right[y][1].append(i)
                else:
                    right[y] = [weight, [i]]
        appeared = [((x, new), (x, a) if x != new else (b, a), n, at) for x, (n, at) in left.items()]
        appeared += [((new, y), (b, y), n, at) for y, (n, at) in right.items()]
        return appeared

    def merge_many(self, pair: Pair, new: int, places: list[int] | np.ndarray) -> list[Appeared]:
        """`merge_few` for many places at once, with numpy."""
        tokens, next_, prev, weights = self.tokens, self.next, self.prev, self.weights
        a, b = pair
        i = np.asarray(places, dtype=next_.dtype)
        j = next_[i]
        occurs = (tokens[i] == a) & (tokens[j] == b)
        i, j = i[occurs], j[occurs]
        if a == b and len(i) > 1:
            # Of overlapping occurrences (`a a a`: j of one is i of the next) the first is merged, the
            # second not, a third again: left to right, as one at a time would.
            order = np.argsort(i)
            i, j = i[order], j[order]
            overlaps = np.flatnonzero(j[:-1] == i[1:])
            if len(overlaps):
                keep = np.ones(len(i), dtype=bool)
                for o in overlaps.tolist():
                    if keep[o]:
                        keep[o + 1] = False
                i, j = i[keep], j[keep]
        k = next_[j]
        tokens[i], tokens[j], next_[i], prev[k] = new, _HOLE, k, i
        h = prev[i]
        x, y, weight = tokens[h], tokens[k], weights[i]
        appeared: list[Appeared] = []
        pick = (x >= 0) & (x != new)
        appeared += [((xx, new), (xx, a), n, at) for xx, n, at in _by_key(x[pick], h[pick], weight[pick])]
        pick = x == new
        if pick.any():
            appeared.append(((new, new), (b, a), int(weight[pick].sum()), h[pick]))
        pick = (y >= 0) & (y != new)
        appeared += [((new, yy), (b, yy), n, at) for yy, n, at in _by_key(y[pick], i[pick], weight[pick])]
        return appeared


def _shared(kind: tuple[str, type], size: int, fill: int) -> tuple[array, np.ndarray]:
    """An `array` of `size` items of `kind` (its typecode and numpy dtype), all `fill`, and a numpy view of it."""
    typecode, dtype = kind
    items = array(typecode, bytes(size * np.dtype(dtype).itemsize))
    view = np.frombuffer(items, dtype=dtype)
    view[:] = fill
    return items, view


def _by_key(
    keys: np.ndarray, places: np.ndarray, weights: np.ndarray
) -> Iterable[tuple[int, int, list[int] | np.ndarray]]:
    """`(key, total weight, places)` for each distinct key: a sort and a sum per group in numpy, or, for a
    handful, a loop in Python, which is quicker there."""
    if len(keys) <= 32:
        groups: dict[int, list] = {}
        for key, place, weight in zip(keys.tolist(), places.tolist(), weights.tolist(), strict=True):
            if key in groups:
                groups[key][0] += weight
                groups[key][1].append(place)
            else:
                groups[key] = [weight, [place]]
        return [(key, n, at) for key, (n, at) in groups.items()]
    order = np.argsort(keys, kind="stable")
    keys, places = keys[order], places[order]
    starts = np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1])))
    sums = np.add.reduceat(weights[order], starts, dtype=np.int64).tolist()
    bounds = [*starts.tolist(), len(keys)]
    return zip(keys[starts].tolist(), sums, [places[s:e] for s, e in pairwise(bounds)], strict=True)
