"""Run the demo as ``scripts/demo.sh`` does and print the figures the README quotes.

Why: README numbers (loss, conversion times, rows and tokens) were typed in by hand and
drifted from what the demo prints. This runs the demo's own commands (the conversions,
the plan, ``train.py yamls/demo.yaml``), times them, reads the manifests, and prints
one line per figure to paste; ``tests/train/test_demo.py`` checks the README's loss line
against the demo's log with :func:`losses` and :data:`README_LOSS`.

    .venv/bin/python scripts/readme_figures.py [--out DIR] [key=value ...]

Extra arguments are training overrides, as for ``scripts/demo.sh``. Times depend on
the machine and its load: the script prints the core count and load average beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: the README sentence the test reads: ``the loss falls from 9.0123 at batch 1 to 2.3456 at batch 300``
README_LOSS = re.compile(r'the loss falls from (\d+\.\d{4}) at batch 1 to (\d+\.\d{4}) at batch (\d+)')
_BATCH = re.compile(r'^\[batch=(\d+)/\d+\]:')
_LOSS = re.compile(r'^\s*Train loss/train/total: (\d+\.\d+)')


def losses(log: str) -> dict[int, str]:
    """Batch -> training loss as Composer's console logger printed it (4 decimals)."""
    out: dict[int, str] = {}
    batch = None
    for line in log.splitlines():
        if m := _BATCH.match(line):
            batch = int(m.group(1))
        elif batch is not None and (m := _LOSS.match(line)):
            out[batch] = m.group(1)
    return out


def _run(argv: list[str], env: dict[str, str]) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f'{" ".join(argv)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}')
    return seconds, proc.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--out', help='output directory (default: a fresh temporary one)')
    parser.add_argument('overrides', nargs='*', metavar='key=value')
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix='foundrymix-readme-'))
    env = {**os.environ, 'HF_HUB_OFFLINE': '1', 'TRANSFORMERS_OFFLINE': '1'}
    py = sys.executable
    fm = [py, '-m', 'foundrymix.cli']
    print(f'machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; output in {out}')
    for name, kind, sample in (('arxiv', 'pretrain', 'arxiv_sample.jsonl'),
                               ('dolly', 'finetune', 'dolly_hhrlhf_sample.jsonl')):
        seconds, _ = _run([*fm, 'convert', kind, f'data/samples/{sample}', '--out', str(out / 'data' / name),
                           '--max-seq-len', '256', '--no-progress', '--overwrite'], env)
        c = json.loads((out / 'data' / name / 'foundrymix.json').read_text())['counts']
        print(f'convert {kind} ({sample}): {seconds:.1f} s wall; {c["documents_read"]:,} documents read, '
              f'{c["documents_written"]:,} written, {c["rows"]:,} rows, {c["tokens"]:,} tokens, '
              f'{c["loss_tokens"]:,} loss tokens')
    overrides = [f'variables.out={out}', *args.overrides]
    _, plan = _run([*fm, 'plan', 'yamls/demo.yaml', *overrides], env)
    for line in plan.splitlines():
        if line.startswith(('max_duration', 'rows trained per stream', 'passes over')):
            print(f'plan: {line}')
    seconds, log = _run([py, 'train.py', 'yamls/demo.yaml', *overrides], env)
    found = losses(log)
    if not found:
        sys.exit('train.py printed no loss (is loggers.console set?)')
    last = max(found)
    print(f'train: {seconds:.0f} s wall for {last} batches (startup included)')
    print(f'README: the loss falls from {found[min(found)]} at batch 1 to {found[last]} at batch {last}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
