#!/usr/bin/env bash
# The core tests without Composer, in a second venv (.venv-core): `pip install -e '.[test-core,examples,peft,hf]'`,
# i.e. what `pip install foundrymix` gives -- the newest torch and numpy pip takes, streaming-community
# 0.14 -- and no Composer. CI (.ci/run) runs it after the whole suite (scripts/test.sh).
# Extra arguments go to pytest in place of the default files below, e.g.
# `bash scripts/test_core.sh tests/plan/test_plan.py -x`. VENV=DIR builds/uses another venv.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv-core}
if [ ! -x $VENV/bin/python ]; then
  "$PY" -m venv $VENV
  $VENV/bin/pip install -q --upgrade pip
fi
if ! $VENV/bin/python -c "import foundrymix, streaming, moto, mistral_common, lightning_fabric, peft, xdist, accelerate" 2>/dev/null \
   || [ pyproject.toml -nt $VENV/.foundrymix-installed ]; then
  # eager: a kept venv moves to the newest releases too (CI starts from none)
  $VENV/bin/pip install -q --upgrade --upgrade-strategy eager -e ".[test-core,examples,peft,hf]"
  # mistral-common, a test-only dependency (its SentencePiece model file), caps numpy <2.4 on Python
  # <=3.12; `pip install foundrymix` has no such cap, so the core is tested on the newest numpy (pip
  # prints the conflict; the tests only read the model file)
  $VENV/bin/pip install -q --upgrade numpy
  touch $VENV/.foundrymix-installed
fi
if $VENV/bin/python -c "import composer" 2>/dev/null; then
  echo "$VENV has composer installed; the core tests must run without it: rm -rf $VENV and rerun" >&2
  exit 1
fi
$VENV/bin/python -c "import importlib.metadata as m
print('core venv:', ', '.join(f'{d} {m.version(d)}' for d in
      ('torch', 'numpy', 'streaming-community', 'transformers', 'tokenizers', 'huggingface-hub',
       'lightning-fabric', 'peft', 'pyarrow', 'datasets')))"

# Core files only (none needs Composer): convert, adopt, plan, the loader (build_loader, resume,
# stages, epochs, cache, shard hashes), the tools; and tests/examples/ (the plain PyTorch loop and
# Lightning Fabric, each killed and resumed) when it exists. Tests that need the trainer skip.
CORE_TESTS=(
  tests/test_core_without_composer.py
  tests/convert/test_convert_pretrain.py
  tests/convert/test_convert_finetune.py
  tests/convert/test_tokenizer_spm.py
  tests/convert/test_adopt.py
  tests/format/test_convert_mds.py
  tests/format/test_integrity.py
  tests/format/test_mds_compat.py
  tests/plan/test_plan.py
  tests/plan/test_plan_checks.py
  tests/plan/test_exact.py
  tests/plan/test_order.py
  tests/plan/test_config_reader.py
  tests/plan/test_mix_config.py
  tests/plan/test_mix_validate.py
  tests/plan/test_mix_weights_in.py
  tests/plan/test_stream_groups.py
  tests/plan/test_adaptive_policy.py
  tests/loader/test_build_loader.py
  tests/loader/test_plain_loader.py
  tests/loader/test_mix_resume.py
  tests/loader/test_state_checks.py
  tests/loader/test_pass_complete.py
  tests/loader/test_mix_epochs.py
  tests/loader/test_mix_collate.py
  tests/loader/test_stages.py
  tests/loader/test_adaptive.py
  tests/loader/test_cache.py
  tests/loader/test_local_shard_hash.py
  tests/tools/test_inspect.py
  tests/tools/test_verify.py
  tests/tools/test_migrate.py
)
if [ -d tests/examples ]; then CORE_TESTS+=(tests/examples); fi

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# two processes where there are two cores, as scripts/test.sh (`-n 0` after it: this process)
XDIST=(-n auto --maxprocesses 2 --dist loadfile)
if [ $# -gt 0 ]; then
  exec $VENV/bin/python -m pytest "${XDIST[@]}" "$@"
fi
exec $VENV/bin/python -m pytest "${XDIST[@]}" "${CORE_TESTS[@]}"
