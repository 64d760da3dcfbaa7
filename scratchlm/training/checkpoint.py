"""The old home of checkpoints, kept so that `scratchlm.training.checkpoint` still imports: it is the module
`scratchlm.run.checkpoint`, where training and the inference commands both reach it."""

import sys

import scratchlm.run.checkpoint as _home

sys.modules[__name__] = _home  # one module under both names: an attribute set on either is seen by both
