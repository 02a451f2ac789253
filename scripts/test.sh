#!/usr/bin/env bash
# The test command (README and CI): set up .venv if needed, then run the test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m 'not slow'` for a quick run without the slow tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# two test processes where there are two cores (a file's tests stay together: its module fixtures are
# built once); `-n 0` after it runs them in this process
# tests/examples/ (a plain loop, Fabric and the HF Trainer: no Composer) run once, in the core venv
# (scripts/test_core.sh, what `pip install foundrymix` gives), unless named here
SKIP=(--ignore=tests/examples)
for a in "$@"; do case $a in tests/examples*) SKIP=();; esac; done
exec .venv/bin/python -m pytest -n auto --maxprocesses 2 --dist loadfile "${SKIP[@]}" "$@"
