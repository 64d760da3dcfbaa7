"""The training loop, its config, optimizers, schedules, budgets and the pretraining stage.

Importing the package registers pretraining's stage (`inputs`, the `[data]` section) in the stage registry
(`scratchlm.training.stage.STAGES`): a config is read only through this package, so every config knows its
default stage, while the config module never imports the inputs."""

from scratchlm.training import inputs  # noqa: F401  (registers pretraining's stage)
