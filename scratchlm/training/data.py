"""The old home of token files and batches, kept so that `scratchlm.training.data` still imports: it is the module
`scratchlm.data.tokens`, where training and the inference commands both reach it."""

import sys

import scratchlm.data.tokens as _home

sys.modules[__name__] = _home  # one module under both names: an attribute set on either is seen by both
