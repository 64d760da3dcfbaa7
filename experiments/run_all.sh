#!/usr/bin/env bash
# The experiments of docs/experiments.md, end to end, on the embedded corpus (no download needed).
# Run from the repository root:  bash experiments/run_all.sh
# Each sweep resumes: run the script again after an interruption and finished runs are skipped.
set -euo pipefail

RUNS=${RUNS:-runs/experiments}     # run directories (checkpoints, metrics): large, not versioned
RESULTS=${RESULTS:-experiments/results}  # the tables and plots quoted in docs/experiments.md
BASE=experiments/base.toml

# 1. Data: 6 MB of the standard library's sources, a 4,096-token BPE tokenizer, token ids as .npy.
if [ ! -f data/stdlib/valid.npy ]; then
    python -c "from scratchlm.data.corpus import build_corpus; build_corpus('data/stdlib', max_bytes=6_000_000)"
    scratchlm prepare data/stdlib --vocab-size 4096
fi

# 2. Learning rate, from too small to divergent (AdamW, warm-up 20 steps, cosine to lr/10, 120 steps).
scratchlm sweep $BASE --mode zip --set optimizer.lr=1e-3,3e-3,1e-2,3e-2,1e-1,1,10 \
    --set optimizer.min_lr=1e-4,3e-4,1e-3,3e-3,1e-2,1e-1,1 --out $RUNS/lr

# 3. Batch size at the base run's budget of 245,760 tokens, from 1 to 64 sequences per step. The warm-up and
#    the evaluation interval are kept at 320 sequences (20 steps of 16), so they scale with the batch size.
scratchlm sweep $BASE --mode zip --set training.batch_size=1,4,16,64 \
    --set schedule.warmup_iters=320,80,20,5 --set eval.interval=320,80,20,5 \
    --set training.max_steps=0 --set training.max_tokens=245760 --out $RUNS/batch

# 4. Ablations at the base learning rate, one change at a time: no RMSNorm, post-norm, no position
#    information (NoPE), SiLU MLP (d_ff = 4 d_model, SwiGLU's parameter count); then no RMSNorm at other rates,
#    to compare with the pre-norm runs of the learning-rate sweep.
scratchlm sweep $BASE --mode one-at-a-time --set model.norm=none,post --set model.positions=none \
    --set model.ffn=silu --out $RUNS/ablations
scratchlm sweep $BASE --mode zip --set model.norm=none --set optimizer.lr=1e-3,3e-2,1e-1 \
    --set optimizer.min_lr=1e-4,3e-3,1e-2 --name no-norm --out $RUNS/no-norm

# 5. Collect the tables and plots quoted in docs/experiments.md.
for sweep in lr batch ablations no-norm; do
    mkdir -p $RESULTS/$sweep
    cp $RUNS/$sweep/results.md $RUNS/$sweep/curves.png $RESULTS/$sweep/
done

scratchlm plot $RUNS/lr/lr=1e-3 $RUNS/no-norm/no-norm_lr=1e-3 $RUNS/lr/lr=1e-2 $RUNS/ablations/norm=none \
    $RUNS/lr/lr=3e-2 $RUNS/no-norm/no-norm_lr=3e-2 \
    --labels "pre-norm lr=1e-3,no norm lr=1e-3,pre-norm lr=1e-2,no norm lr=1e-2,pre-norm lr=3e-2,no norm lr=3e-2" \
    --title "RMSNorm against none at three learning rates" --out $RESULTS/norm-vs-none.png

# 6. Every run's loss on the whole validation file (671 windows of 128 tokens; the sweep tables show the
#    training loop's estimate on 80 fixed windows).
{
    echo "| sweep | run | whole-file validation loss | perplexity |"
    echo "| --- | --- | --- | --- |"
    for run in $RUNS/*/*/; do
        [ -f "$run/summary.json" ] || continue
        read -r _ loss _ ppl < <(scratchlm eval --run "$run" --data data/stdlib/valid.npy 2>/dev/null)
        echo "| $(basename "$(dirname "$run")") | $(basename "$run") | $loss | $ppl |"
    done
} > $RESULTS/whole_file_eval.md
