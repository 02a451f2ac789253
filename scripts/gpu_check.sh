#!/usr/bin/env bash
# The GPU checks in one command, on a machine with CUDA (see docs/gpu.md):
#   1. set up .venv (scripts/setup.sh; PyPI's torch 2.7.0 wheel for Linux carries CUDA 12.6),
#   2. try flash-attn (a prebuilt wheel only: its setup fetches one matching torch/CUDA/Python;
#      a source build takes hours, so it is cut off after FLASH_ATTN_TIMEOUT seconds and
#      the flash_attention_2 tests and benchmark rows are then skipped, saying so),
#   3. run the CUDA tests (the tests that skip without CUDA, plus the collective audit),
#   4. run benchmarks/bench_gpu.py (results also in OUT/bench_gpu.json).
# Extra arguments go to bench_gpu.py, e.g. `bash scripts/gpu_check.sh --steps 50`.
# OUT (default runs/gpu_check) receives the logs; nothing else is written outside .venv.
# GPU_CHECK_PYTHON=python3 skips step 1 and uses that interpreter as it is; GPU_CHECK_OFFLINE=1 skips
# step 2 (a machine without network: pip would only retry). GPU_CHECK_TESTS overrides step 3's test
# files; they are cut off after GPU_CHECK_TEST_TIMEOUT seconds (default 1200).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
if [ -n "${GPU_CHECK_PYTHON:-}" ]; then
  # an interpreter whose packages are installed already (a machine without network: the
  # packages travel as wheels, see docs/gpu.md); scripts/setup.sh would need PyPI
  PY=$GPU_CHECK_PYTHON
else
  bash scripts/setup.sh || { echo "gpu_check: scripts/setup.sh failed"; exit 2; }
  PY=.venv/bin/python
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: torch sees no CUDA device (torch $("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda)')); nothing to check"
  exit 2
fi
"$PY" -c "import torch, composer, streaming, transformers; print('gpu_check:', torch.cuda.device_count(), 'x', torch.cuda.get_device_name(), '| torch', torch.__version__, 'CUDA', torch.version.cuda, '| composer', composer.__version__, '| streaming', streaming.__version__, '| transformers', transformers.__version__)"

FLASH="flash-attn: installed"
if [ -n "${GPU_CHECK_OFFLINE:-}" ] && ! "$PY" -c "import flash_attn_2_cuda" 2>/dev/null; then
  FLASH="flash-attn: NOT installed (GPU_CHECK_OFFLINE: no network to fetch it); flash_attention_2 is skipped"
elif ! "$PY" -c "import flash_attn_2_cuda" 2>/dev/null; then
  echo "gpu_check: installing flash-attn (prebuilt wheel; giving up after ${FLASH_ATTN_TIMEOUT:-900} s) ..."
  "$PY" -m pip install -q packaging ninja wheel >"$OUT/flash_attn_install.log" 2>&1
  if timeout "${FLASH_ATTN_TIMEOUT:-900}" "$PY" -m pip install --no-build-isolation flash-attn \
       >>"$OUT/flash_attn_install.log" 2>&1 && "$PY" -c "import flash_attn_2_cuda" 2>>"$OUT/flash_attn_install.log"; then
    FLASH="flash-attn: installed $("$PY" -c 'import flash_attn; print(flash_attn.__version__)')"
  else
    "$PY" -m pip uninstall -y -q flash-attn >/dev/null 2>&1
    FLASH="flash-attn: NOT installed (no wheel for this torch/CUDA/Python; see $OUT/flash_attn_install.log); flash_attention_2 is skipped"
  fi
fi
echo "gpu_check: $FLASH"

status=0
echo "gpu_check: CUDA tests ..."
# shellcheck disable=SC2086  # a list of test paths
timeout "${GPU_CHECK_TEST_TIMEOUT:-1200}" "$PY" -m pytest -q -rs -p no:cacheprovider \
  ${GPU_CHECK_TESTS:-tests/train/test_collectives.py tests/train/test_gpu_settings.py tests/train/test_gpu_runs.py tests/train/test_fast_paths.py tests/loader/test_pin_memory.py} \
  2>&1 | tee -a "$OUT/tests.log" || status=1
echo "gpu_check: benchmarks/bench_gpu.py ..."
"$PY" benchmarks/bench_gpu.py --device gpu --json "$OUT/bench_gpu.json" "$@" 2>"$OUT/bench_gpu.err" \
  | tee "$OUT/bench_gpu.txt" || status=1
echo "gpu_check: $FLASH"
echo "gpu_check: $([ $status = 0 ] && echo 'all passed' || echo 'FAILED (logs in '"$OUT"')')"
exit $status
