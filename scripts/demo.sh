#!/usr/bin/env bash
# The main job end to end on the bundled samples, CPU, no network:
# convert both samples -> inspect -> plan the mix -> train a tiny Llama -> per-stream report.
# Outputs go to out/demo/ (set OUT=... to change). Extra arguments are training overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUT=${OUT:-out/demo}
FM=.venv/bin/foundrymix
rm -rf "$OUT"
echo "== 1. convert the pretrain sample (arXiv, 20 papers) to MDS"
$FM convert pretrain data/samples/arxiv_sample.jsonl --out "$OUT/data/arxiv" --max-seq-len 256
echo "== 2. convert the finetune sample (Dolly/HH, 1000 prompt/response pairs) to MDS"
$FM convert finetune data/samples/dolly_hhrlhf_sample.jsonl --out "$OUT/data/dolly" --max-seq-len 256
echo "   again with 5% held out for evaluation (yamls/finetune.yaml): $OUT/data/dolly_split/{train,eval}"
$FM convert finetune data/samples/dolly_hhrlhf_sample.jsonl --out "$OUT/data/dolly_split" --max-seq-len 256 \
    --holdout 5% --no-progress
echo "== 3. what is inside"
$FM inspect "$OUT/data/dolly" --decode 1
echo "== 4. the plan: samples and tokens per stream, per epoch and for the run"
$FM plan yamls/demo.yaml "variables.out=$OUT" "$@"
echo "== 5. train (tiny Llama, CPU), checkpoints every 100 batches"
.venv/bin/python train.py yamls/demo.yaml "variables.out=$OUT" "$@"
echo "== 6. a curriculum over the same data: three stages switched at exact batches (plan + picture)"
$FM plan yamls/curriculum.yaml "variables.out=$OUT" --png "$OUT/curriculum_plan.png"
echo "   train it with: .venv/bin/python train.py yamls/curriculum.yaml variables.out=$OUT"
