"""Training recipes: named sets of choices that a config applies on top of a model's shape.

A recipe is `{section: {key: value}}`, the same shape as a `TrainConfig` dict, holding only the choices that
make up the recipe: the optimizer and its rates, the model's components, the kind of schedule. The model's
size, the batch and the warm-up length belong to the shape that a recipe is applied to, and each user of the
recipe states them itself. `FAST` is defined here once; the quickstart, the benchmarks and the shipped configs
(`configs/tinystories-fast.toml`, `configs/owt-leaderboard.toml`, checked by a test) all take it from here.
"""

from __future__ import annotations

import copy
from typing import Any

Recipe = dict[str, dict[str, Any]]

#: The specification's recipe (the CS336 assignment-1 handout): AdamW and a cosine schedule, the config's
#: defaults, so it changes nothing.
HANDOUT: Recipe = {}

#: The recipe of docs/experiments.md ("A faster recipe"): Muon for the hidden matrices and AdamW with rates of
#: their own for the gains (`lr`), the embeddings and the head; QK-norm, ReLU², zero-initialised output
#: projections and logit soft-capping; a warm-up / stable / linear-decay schedule that decays over the second
#: half of the run. Value embeddings are part of the recipe too, but how many tables a model has depends on its
#: depth, so `model.value_embeddings` is the shape's to set (as are the warm-up's length and the batch).
FAST: Recipe = {
    "model": {"qk_norm": True, "ffn": "relu2", "zero_init": True, "logit_softcap": 15.0},
    "optimizer": {
        "name": "muon",
        "lr": 0.01,
        "min_lr": 0.0,
        "muon_lr": 0.03,
        "embedding_lr": 0.5,
        "head_lr": 0.008,
        "betas": [0.8, 0.95],
        "weight_decay": 0.0,
    },
    "schedule": {"kind": "wsd", "decay_fraction": 0.5},
}

RECIPES: dict[str, Recipe] = {"spec": HANDOUT, "fast": FAST}


def merged(base: Recipe, changes: Recipe) -> Recipe:
    """`base` with the keys of `changes` set, section by section (a copy: neither argument is changed); a
    value that is not a table (a mistake the config's checks name) replaces the section whole."""
    result = copy.deepcopy(base)
    for section, values in changes.items():
        kept = result.get(section, {})
        both = isinstance(kept, dict) and isinstance(values, dict)
        result[section] = kept | copy.deepcopy(values) if both else copy.deepcopy(values)
    return result
