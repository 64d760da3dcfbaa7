"""The kinds of parallelism scratchlm knows, by name: the config's `training.parallel` takes one of them, and
`scratchlm.parallel.PARALLELISMS` holds the function that applies each (a test keeps the two the same). A
module of its own, without torch, so that reading a config does not import FSDP."""

from typing import Literal

ParallelName = Literal["ddp", "fsdp"]
