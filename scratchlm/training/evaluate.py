"""The old home of evaluation, kept so that `scratchlm.training.evaluate` still imports: it is the module
`scratchlm.evaluation`, where training and the inference commands both reach it."""

import sys

import scratchlm.evaluation as _home

sys.modules[__name__] = _home  # one module under both names: an attribute set on either is seen by both
