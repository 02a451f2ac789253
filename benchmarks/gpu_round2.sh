#!/usr/bin/env bash
# Issue 53 (GPU round 2) on one H100/H200 in one call of about 10 minutes:
#   1. set-up: GPU_CHECK_PYTHON (default python3, the image's torch) with the wheels of
#      scripts/gpu_wheels.sh carried as gpu-wheels/ (installed with --no-deps into /tmp/site), and
#      the first torchao of gpu-wheels/torchao/ whose float8 module imports on that torch;
#   2. the CUDA tests of this round (FSDP2 stop/resume bitwise, FSDP2 + fused loss + compile,
#      amp_fp8's loss curve vs bf16, the fused optimizer), cut off after ROUND2_TEST_TIMEOUT s (240);
#   3. benchmarks/bench_gpu.py on ROUND2_ROWS (default: its GPU table -- 125M/64, 1.3B bf16 and fp8,
#      3B FSDP2 with activation checkpointing), --steps 15 --warmup 5 --repeats 3, each row cut off
#      after ROUND2_ROW_TIMEOUT s (300), the whole script after ROUND2_BUDGET s (560).
# Logs and bench_gpu.json go to OUT (default $OUT of the device run, else runs/gpu_round2).
# Here, before the device call: bash scripts/gpu_wheels.sh 3.12 gpu-wheels; then run with
# carry ["gpu-wheels"]: bash benchmarks/gpu_round2.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_round2}
mkdir -p "$OUT"
PY=${GPU_CHECK_PYTHON:-python3}
SITE=/tmp/site
if [ -d gpu-wheels ]; then
  "$PY" -m pip install -q --no-index --no-deps --target "$SITE" gpu-wheels/*.whl >"$OUT/setup.log" 2>&1
  for whl in $(ls -r gpu-wheels/torchao/*.whl 2>/dev/null); do  # newest first
    rm -rf "$SITE"/torchao*
    "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "$whl" >>"$OUT/setup.log" 2>&1
    PYTHONPATH=$SITE "$PY" -c "import torchao.float8" 2>>"$OUT/setup.log" && break
  done
fi
export PYTHONPATH=$SITE:$PWD:$PWD/tests HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
"$PY" - <<'PYEOF' 2>&1 | tee "$OUT/versions.txt"
import torch, composer, transformers
try:
    import torchao; ao = torchao.__version__
    import torchao.float8  # noqa: F401
except ImportError as e:
    ao = f'not importable ({e})'
print('gpu_round2:', torch.cuda.get_device_name(), torch.cuda.get_device_capability(), '| torch', torch.__version__,
      'CUDA', torch.version.cuda, '| composer', composer.__version__, '| transformers', transformers.__version__,
      '| torchao', ao)
PYEOF
status=0
echo "gpu_round2: CUDA tests ..."
timeout "${ROUND2_TEST_TIMEOUT:-240}" "$PY" -m pytest -q -rs -p no:cacheprovider -p no:randomly \
  tests/train/test_gpu_round2.py 'tests/train/test_gpu_runs.py::test_fsdp_stop_resume_is_bitwise_and_exports[fsdp2]' \
  tests/train/test_optim.py 2>&1 | tee "$OUT/tests.log" | tail -30 || status=1
echo "gpu_round2: benchmarks/bench_gpu.py ..."
# shellcheck disable=SC2086
# what is left of ROUND2_BUDGET s (default 560: the device call's 600 less the transfers) after
# the tests; bench_gpu.json is rewritten after each row, so a cut-off run keeps its finished rows
LEFT=$(( ${ROUND2_BUDGET:-560} - SECONDS ))
timeout "$LEFT" "$PY" benchmarks/bench_gpu.py --device gpu --steps 15 --warmup 5 --repeats 3 \
  --row-timeout "${ROUND2_ROW_TIMEOUT:-300}" ${ROUND2_ROWS:+--rows $ROUND2_ROWS} --json "$OUT/bench_gpu.json" \
  2>"$OUT/bench_gpu.err" | tee "$OUT/bench_gpu.txt" || status=1
echo "gpu_round2: $([ $status = 0 ] && echo 'all passed' || echo 'FAILED (logs in '"$OUT"')')"
exit $status
