#!/usr/bin/env bash
# Create .venv (if missing) and install foundrymix with its test extra. Idempotent.
# composer 0.32 pins torch <2.7.1, so pip takes torch 2.7.0 from PyPI (a few GB, ~3-4 min once).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
fi
if ! .venv/bin/python -c "import foundrymix, streaming, composer, moto, mistral_common" 2>/dev/null \
   || [ pyproject.toml -nt .venv/.foundrymix-installed ]; then
  .venv/bin/pip install -q -e ".[test]"
  touch .venv/.foundrymix-installed
fi
