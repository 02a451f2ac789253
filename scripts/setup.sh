#!/usr/bin/env bash
# Create .venv (if missing) and install foundrymix with its test extra (Composer included). Idempotent.
# composer 0.32 pins torch <2.7.1, so pip takes torch 2.7.0 from PyPI (a few GB, ~3-4 min once).
#
# One streaming distribution everywhere: streaming-community (the maintained fork of mosaicml-streaming,
# import name `streaming`), the one `pip install foundrymix` takes. Composer does not require a streaming
# package; tests/format/test_mds_compat.py reads shards written by mosaicml-streaming 0.13 and Foundry.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
fi
streaming_dist() {  # which distribution provides the importable `streaming` (empty: none)
  .venv/bin/python -c "import importlib.metadata as m, sys
for d in ('mosaicml-streaming', 'streaming-community'):
    try: m.version(d); print(d)
    except m.PackageNotFoundError: pass" 2>/dev/null | tr '\n' ' '
}
if ! .venv/bin/python -c "import foundrymix, streaming, composer, moto, mistral_common" 2>/dev/null \
   || [ "$(streaming_dist)" != "streaming-community " ] \
   || [ pyproject.toml -nt .venv/.foundrymix-installed ]; then
  # a venv from before the swap was removed: take mosaicml-streaming out (both write `streaming/`)
  .venv/bin/pip uninstall -q -y mosaicml-streaming streaming-community 2>/dev/null || true
  .venv/bin/pip install -q -e ".[test]"
  touch .venv/.foundrymix-installed
fi
