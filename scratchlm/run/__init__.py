"""The run directory: the one contract between training, sweeps, the quickstart, `generate`, `eval` and `plot`.

A training run lives in one directory (`logging.run_dir`):

    RUN/
      config.toml             the resolved configuration the run trained with
      metrics.jsonl           one JSON record per line: train records and eval records (`scratchlm.run.metrics`)
      checkpoints/step_00001000.pt   the most recent `checkpoint.keep` checkpoints (under `training.parallel =
                                     "fsdp"`, directories of shards: step_00001000/, `scratchlm.run.sharded`)
      summary.json            how the run ended: steps, tokens, time, losses, the stop reason (`RunSummary`)
      .lock                   held by the process training in the run (`scratchlm.run.lock`)
      .scratchlm-output       marks the directory as a run (`scratchlm.io`): anything else is refused

Everything that reads or writes these files goes through this package: `RunDirectory` knows the paths and
finds checkpoints and locks the run for one trainer, `Checkpoint` is the one reader and writer of checkpoint
files, with what a training run adds in its `TrainingState` (`scratchlm.run.checkpoint`, the only module that
knows their keys; `scratchlm.run.sharded` writes and reads the sharded ones' shards), `read_any` reads either
kind and `load_checkpoint` is the one way any checkpoint goes into a model (`scratchlm.run.load`), `check_pair`
decides whether a tokenizer belongs to a model, `RunSummary` is the typed summary with its `StopReason`,
`read_metrics` parses the metrics log, and `load_trained` loads a trained model together with its tokenizer for
inference.
"""

from scratchlm.run.checkpoint import Checkpoint, TrainingState
from scratchlm.run.directory import RunDirectory
from scratchlm.run.load import TrainedModel, check_pair, load_trained
from scratchlm.run.metrics import read_metrics
from scratchlm.run.summary import RunSummary, StopReason

__all__ = [
    "Checkpoint",
    "RunDirectory",
    "RunSummary",
    "StopReason",
    "TrainedModel",
    "TrainingState",
    "check_pair",
    "load_trained",
    "read_metrics",
]
