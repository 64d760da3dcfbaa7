"""`scratchlm download tinystories|owt-sample`: fetch a dataset of the CS336 assignment-1 handout, resumably."""

from __future__ import annotations

import argparse

from scratchlm.cli.options import add_out_argument

HELP = "Download TinyStories or the OpenWebText sample (resumes an interrupted download)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from scratchlm.data.download import DATASETS

    parser.add_argument("dataset", choices=list(DATASETS), help="which dataset")
    add_out_argument(
        parser,
        "where to put the files (default: data/DATASET); --dir is the older spelling",
        aliases=("--dir",),
    )
    parser.add_argument(
        "--base-url",
        metavar="URL",
        help="server to download from (default: $HF_ENDPOINT or https://huggingface.co), e.g. a mirror",
    )


def run(args: argparse.Namespace) -> None:
    from scratchlm.console import console
    from scratchlm.data.download import download_dataset

    paths = download_dataset(args.dataset, args.out or f"data/{args.dataset}", base_url=args.base_url)
    for path in paths:
        console.print(f"{path}  {path.stat().st_size / 1e6:,.1f} MB")
