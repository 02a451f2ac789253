#!/usr/bin/env bash
# A fresh install of foundrymix from this checkout resolves in one pass: an empty venv, pip upgraded,
# then `pip install SPEC` (default `.`; e.g. `'.[composer]'`), timed. Fails (exit 3) when pip
# backtracked -- its "pip is looking at multiple versions of X" line, which precedes minutes of
# trying older releases -- and prints the versions it settled on. Not run by CI (minutes, network).
# usage: bash benchmarks/bench_install.sh ['.[composer]' [VENV_DIR]]
set -euo pipefail
cd "$(dirname "$0")/.."
SPEC=${1:-.}
VENV=${2:-$(mktemp -d)/venv}
PY=${PYTHON:-python3}
LOG=$VENV.log
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
start=$(date +%s)
"$VENV/bin/pip" install "$SPEC" >"$LOG" 2>&1 || { tail -20 "$LOG"; exit 1; }
took=$(( $(date +%s) - start ))
"$VENV/bin/python" -c "import importlib.metadata as m
def v(d):
    try: return f'{d} {m.version(d)}'
    except m.PackageNotFoundError: return f'{d} -'
print('installed:', ', '.join(v(d) for d in ('torch', 'numpy', 'transformers', 'tokenizers', 'huggingface-hub',
                                             'datasets', 'fsspec', 'composer')))"
echo "pip install '$SPEC': $((took / 60)) min $((took % 60)) s, load $(cut -d' ' -f1-3 /proc/loadavg), log $LOG"
if grep -q 'looking at multiple versions' "$LOG"; then
  grep 'looking at multiple versions' "$LOG" | sort | uniq -c
  echo "pip backtracked (above): tighten the lower bound of those packages in pyproject.toml" >&2
  exit 3
fi
