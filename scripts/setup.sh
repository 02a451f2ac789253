#!/usr/bin/env bash
# Create .venv (if missing) and install foundrymix with its test extra (Composer included). Idempotent.
# composer 0.32 pins torch <2.7.1, so pip takes torch 2.7.0 from PyPI (a few GB, ~3-4 min once).
#
# The streaming package: `pip install foundrymix` requires streaming-community 0.14 (the maintained
# fork, import name `streaming`, numpy <3). This venv -- the Composer path and the whole suite --
# stays on mosaicml-streaming 0.13, the release composer 0.32 shipped with and the one the Composer
# path's tests and figures were made on. Both write the same `streaming/` package, so they must never
# be installed together (uninstalling one deletes the other's files): the install is followed by an
# explicit swap, and both are removed first on a reinstall. `pip check` then reports that foundrymix
# wants streaming-community: expected here. scripts/test_core.sh tests the core on streaming-community
# with the newest torch and numpy (.venv-core); docs/install.md says which versions each part runs on.
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
   || [ "$(streaming_dist)" != "mosaicml-streaming " ] \
   || [ pyproject.toml -nt .venv/.foundrymix-installed ]; then
  .venv/bin/pip uninstall -q -y mosaicml-streaming streaming-community 2>/dev/null || true
  # numpy <2.2: mosaicml-streaming 0.13's bound, so the swap below changes no numpy
  .venv/bin/pip install -q -e ".[test]" 'numpy<2.2'
  .venv/bin/pip uninstall -q -y streaming-community
  .venv/bin/pip install -q 'mosaicml-streaming==0.13.*'
  touch .venv/.foundrymix-installed
fi
