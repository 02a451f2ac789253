"""``convert --overwrite`` replaces only a foundrymix dataset; a conversion with no rows
publishes nothing; ``--out`` that looks like a mistyped URL is refused.

Every case runs the real CLI (``python -m foundrymix.cli convert ...``) in a subprocess
on the bundled samples or small files, and checks the user's files byte for byte.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from convert_helpers import read_rows, tree_hash, write_jsonl
from helpers import ROOT, SAMPLES
from foundrymix.cli import main
from foundrymix.convert.pretrain import PretrainOptions, convert_pretrain
from foundrymix.format.schema import Manifest

ARXIV = SAMPLES / 'arxiv_sample.jsonl'
DOLLY = SAMPLES / 'dolly_hhrlhf_sample.jsonl'


def cli(*argv, cwd=None, timeout=120) -> subprocess.CompletedProcess:
    """``python -m foundrymix.cli convert ARGV --no-progress --workers 1`` with this worktree's
    package first on the path."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get('PYTHONPATH')])]), TOKENIZERS_PARALLELISM='false')
    return subprocess.run([sys.executable, '-m', 'foundrymix.cli', 'convert', *map(str, argv),
                           '--no-progress', '--workers', '1'],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def project(root: Path) -> Path:
    """A folder the user owns that is no dataset: source code and notes."""
    (root / 'src').mkdir(parents=True)
    (root / 'src' / 'main.py').write_text('print("hello")\n')
    (root / 'NOTES.md').write_text('# notes\n')
    return root


def dataset(out: Path, max_seq_len: int = 256, size_limit: str = '64mb') -> Manifest:
    """A real foundrymix output of the arxiv sample, made in this process (set-up only)."""
    return convert_pretrain([str(ARXIV)], str(out), PretrainOptions(max_seq_len=max_seq_len, workers=1,
                                                                    size_limit=size_limit))


KINDS = {'pretrain': (ARXIV, ['--max-seq-len', '256']),
         'finetune': (DOLLY, ['--max-seq-len', '256'])}


# ---------------------------------------------------------------- --overwrite on foreign folders

@pytest.mark.parametrize('engine', ['local', 'ray'])
@pytest.mark.parametrize('kind', ['pretrain', 'finetune'])
def test_overwrite_refuses_a_folder_foundrymix_did_not_write(tmp_path, kind, engine):
    if engine == 'ray' and kind == 'finetune':
        pytest.skip('the engines share one up-front check; one Ray case is enough')
    proj = project(tmp_path / 'proj2')
    before = tree_hash(tmp_path)
    src, opts = KINDS[kind]
    want = (f'foundrymix convert: error: {proj} holds files foundrymix did not write (NOTES.md, src/); '
            f'--overwrite replaces only a foundrymix dataset (foundrymix.json, index.json and the shards '
            f'index.json lists). Choose another --out, or remove them yourself\n')
    r = cli(kind, src, '--out', proj, '--overwrite', '--engine', engine, *opts)
    assert (r.returncode, r.stderr) == (2, want)
    assert tree_hash(tmp_path) == before  # nothing deleted, changed or created (no partial beside it)
    # refused before any work: an unknown tokenizer is never even loaded
    r = cli(kind, src, '--out', proj, '--overwrite', '--engine', engine, '--tokenizer', 'no-such-tok', *opts)
    assert (r.returncode, r.stderr) == (2, want)


def test_overwrite_refuses_a_dataset_with_foreign_files(tmp_path):
    out = tmp_path / 'out'
    dataset(out)
    (out / 'README.txt').write_text('my notes about this dataset\n')
    (out / 'eval').mkdir()
    (out / 'eval' / 'scores.csv').write_text('a,b\n')
    (out / 'shard.00099.mds').write_text('named like a shard, not listed in index.json\n')
    before = tree_hash(tmp_path)
    r = cli('pretrain', ARXIV, '--out', out, '--max-seq-len', '128', '--overwrite')
    assert r.returncode == 2
    assert f'{out} holds files foundrymix did not write (README.txt, eval/, shard.00099.mds);' in r.stderr
    assert tree_hash(tmp_path) == before


def test_overwrite_refuses_an_mds_folder_without_manifest(tmp_path):
    """streaming's own MDSWriter output (index.json, no foundrymix.json) is not foundrymix's."""
    out = tmp_path / 'out'
    dataset(out)
    os.remove(out / 'foundrymix.json')
    before = tree_hash(tmp_path)
    r = cli('pretrain', ARXIV, '--out', out, '--max-seq-len', '128', '--overwrite')
    assert r.returncode == 2
    assert (f'{out} holds files foundrymix did not write (index.json, shard.00000.mds; it has no '
            f'foundrymix.json);') in r.stderr, r.stderr
    assert tree_hash(tmp_path) == before


def test_overwrite_replaces_a_dataset_with_only_its_files(tmp_path):
    """The old shards the new index does not reuse are removed; exactly the new dataset remains."""
    out = tmp_path / 'out'
    old = dataset(out, size_limit='100kb')
    old_shards = sorted(os.listdir(out))
    r = cli('pretrain', ARXIV, '--out', out, '--max-seq-len', '128', '--overwrite')
    assert r.returncode == 0, r.stderr
    index = json.loads((out / 'index.json').read_text())
    shards = [s['raw_data']['basename'] for s in index['shards']]
    assert shards == ['shard.00000.mds'] and len(old_shards) == 2 + 8, old_shards
    assert sorted(os.listdir(out)) == ['foundrymix.json', 'index.json', 'shard.00000.mds']
    new = Manifest.read(str(out))
    assert new.max_seq_len == 128 and len(read_rows(out)) == new.counts.rows > old.counts.rows
    assert sorted(os.listdir(tmp_path)) == ['out']  # no partial or .old left beside it


def test_overwrite_accepts_an_empty_folder(tmp_path):
    out = tmp_path / 'out'
    out.mkdir()
    r = cli('finetune', DOLLY, '--out', out, '--max-seq-len', '256', '--overwrite')
    assert r.returncode == 0, r.stderr
    assert Manifest.read(str(out)).counts.rows == len(read_rows(out)) > 0


@pytest.mark.parametrize('mode', [0o2775, 0o555, 0o700])
def test_an_existing_out_folder_keeps_its_mode_and_group(tmp_path, mode):
    """The folder the user made for the output (a team's setgid 2775, a read-only 555, a
    private 700) keeps its permission bits and group; before, the rename put the partial
    directory's 755 and the writer's group in its place. So does an output replaced with
    --overwrite."""
    out = tmp_path / 'out'
    out.mkdir()
    # a group other than the writer's (root may give any; others, one of their groups)
    group = 4242 if os.geteuid() == 0 else next((g for g in os.getgroups() if g != os.getgid()), os.getgid())
    os.chown(out, -1, group)
    os.chmod(out, mode)
    r = cli('pretrain', ARXIV, '--out', out, '--max-seq-len', '256')
    assert r.returncode == 0, r.stderr
    st = out.stat()
    assert (oct(st.st_mode & 0o7777), st.st_gid) == (oct(mode), group)
    assert Manifest.read(str(out)).counts.rows == len(read_rows(out)) > 0
    os.chmod(out, 0o750)
    r = cli('pretrain', ARXIV, '--out', out, '--max-seq-len', '128', '--overwrite')
    assert r.returncode == 0, r.stderr
    assert (oct(out.stat().st_mode & 0o7777), out.stat().st_gid) == (oct(0o750), group)
    assert Manifest.read(str(out)).max_seq_len == 128


@pytest.mark.slow  # about 25 s on a loaded 2-core machine (two CLI runs, one killed)
def test_overwrite_after_a_killed_conversion(tmp_path):
    """What a SIGKILLed conversion leaves (its partial directory beside --out, the old output
    untouched) is replaced by the next --overwrite, and the leftover partial is removed."""
    big = tmp_path / 'big.jsonl'
    big.write_bytes(ARXIV.read_bytes() * 4)
    out = tmp_path / 'out'
    dataset(out)
    env = dict(os.environ, PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM='false')
    proc = subprocess.Popen([sys.executable, '-m', 'foundrymix.cli', 'convert', 'pretrain', str(big),
                             '--out', str(out), '--max-seq-len', '64', '--size-limit', '256kb',
                             '--workers', '1', '--no-progress', '--overwrite'], env=env)
    try:
        deadline = time.time() + 240  # a hang guard: start-up and imports on a loaded machine
        partial = None
        while time.time() < deadline and proc.poll() is None:  # wait for its first shard
            partials = [p for p in tmp_path.iterdir() if p.name.startswith('.out.partial-')]
            if partials and any(f.name.startswith('shard.') for f in partials[0].iterdir()):
                partial = partials[0]
                break
            time.sleep(0.05)
        assert partial is not None, 'the conversion finished before it could be killed'
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert partial.exists() and (out / 'foundrymix.json').exists()  # what the kill left
    r = cli('pretrain', ARXIV, '--out', out, '--max-seq-len', '128', '--overwrite')
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(tmp_path)) == ['big.jsonl', 'out']
    assert Manifest.read(str(out)).max_seq_len == 128


# ---------------------------------------------------------------- conversions with no rows

def convert(capsys, *argv) -> tuple[int, str]:
    """The CLI in this process (the tokenizer loads once for the module: seconds saved per case)."""
    rc = main(['convert', *map(str, argv), '--no-progress', '--workers', '1'])
    return rc, capsys.readouterr().err


def nothing_published(capsys, where: Path, *argv) -> str:
    """Run a conversion that has no rows: exit 2, one line, ``where`` byte for byte as before."""
    before = tree_hash(where)
    rc, err = convert(capsys, *argv)
    assert rc == 2, err
    assert err.startswith('foundrymix convert: error: no rows to write, so nothing was published: ')
    assert err.count('\n') == 1 and 'Traceback' not in err
    assert tree_hash(where) == before
    return err


@pytest.mark.parametrize('existing', [False, True])
def test_pretrain_shorter_than_one_row_publishes_nothing(capsys, tmp_path, existing):
    ref = convert_pretrain([str(ARXIV)], str(tmp_path / 'ref'), PretrainOptions(max_seq_len=256, workers=1))
    total = ref.counts.rows * 256 + ref.counts.tail_tokens  # every token of the input, with EOS
    out = tmp_path / 'w' / 'out'
    if existing:  # an earlier dataset stays as it was
        convert_pretrain([str(ARXIV)], str(out), PretrainOptions(max_seq_len=256, workers=1))
    (tmp_path / 'w').mkdir(exist_ok=True)
    err = nothing_published(capsys, tmp_path / 'w', 'pretrain', ARXIV, '--out', out,
                            '--max-seq-len', '1000000000', '--overwrite')
    assert err.endswith(
        f'20 documents read; all {total:,} tokens are fewer than one row of --max-seq-len 1,000,000,000 '
        f'(rows are never padded). Use --max-seq-len {total:,} or less, or convert more input\n'), err
    # the advice works: at that length there is exactly one row
    m = convert_pretrain([str(ARXIV)], str(tmp_path / 'one'), PretrainOptions(max_seq_len=total, workers=1))
    assert m.counts.rows == 1


def test_preprocess_skipping_every_record_publishes_nothing(capsys, tmp_path, monkeypatch):
    (tmp_path / 'skipall.py').write_text('def none(record):\n    return None\n')
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'w').mkdir()
    err = nothing_published(capsys, tmp_path / 'w', 'pretrain', ARXIV, '--out', tmp_path / 'w' / 'out',
                            '--max-seq-len', '256', '--preprocess', 'skipall:none')
    assert err.endswith('20 documents read; 20 skipped by --preprocess skipall:none (it returned None). '
                        'Check that it returns the record (a dict) for the records to keep\n'), err


def test_finetune_all_too_long_publishes_nothing(capsys, tmp_path):
    src = write_jsonl(tmp_path / 'long.jsonl', [{'prompt': 'Tell me ' * 20, 'response': ' yes ' * 20}] * 7)
    (tmp_path / 'w').mkdir()
    err = nothing_published(capsys, tmp_path / 'w', 'finetune', src, '--out', tmp_path / 'w' / 'out',
                            '--max-seq-len', '16')
    assert err.endswith(
        '7 examples read; 7 dropped as longer than --max-seq-len 16 (--too-long drop). Raise --max-seq-len '
        '(keeps every token), or pass --too-long truncate (keeps only the first 16 tokens of each such '
        'example; the rest are lost)\n'), err


def test_finetune_truncated_to_no_loss_publishes_nothing(capsys, tmp_path):
    """Truncation keeps the prompt only: no response token is left to train on."""
    src = write_jsonl(tmp_path / 'long.jsonl', [{'prompt': 'Tell me ' * 20, 'response': ' yes'}] * 5)
    (tmp_path / 'w').mkdir()
    err = nothing_published(capsys, tmp_path / 'w', 'finetune', src, '--out', tmp_path / 'w' / 'out',
                            '--max-seq-len', '16', '--too-long', 'truncate')
    assert err.endswith(
        '5 examples read; 5 dropped with no loss token left (--too-long truncate keeps the first 16 '
        'tokens: responses beyond them are cut off). Raise --max-seq-len so that the responses fit\n'), err


def test_every_record_bad_publishes_nothing(capsys, tmp_path):
    src = tmp_path / 'bad.jsonl'
    src.write_text('{"title": "no text"}\n' * 3)
    (tmp_path / 'w').mkdir()
    err = nothing_published(capsys, tmp_path / 'w', 'pretrain', src, '--out', tmp_path / 'w' / 'out',
                            '--max-seq-len', '256', '--on-error', 'skip')
    assert err.endswith(f'3 documents read; 3 skipped as bad records (--on-error skip; first at {src}:1: '
                        f'missing_field). Fix them, or convert other input\n'), err


# ---------------------------------------------------------------- --out as a mistyped URL

@pytest.mark.parametrize('out, folder, right', [('s3:/bucket/prefix', 's3:', 's3://bucket/prefix'),
                                                ('s3:bucket', 's3:bucket', 's3://bucket'),
                                                ('gs:/bucket/x', 'gs:', None),
                                                ('http:host/x', 'http:host', None)])
def test_out_that_looks_like_a_mistyped_url_is_refused(capsys, tmp_path, monkeypatch, out, folder, right):
    monkeypatch.chdir(tmp_path)
    rc, err = convert(capsys, 'pretrain', ARXIV, '--out', out, '--max-seq-len', '256')
    what = (f"foundrymix convert: error: --out {out}: looks like a mistyped URL (as a local path it would "
            f"create a folder '{folder}'); ")
    assert rc == 2
    if right:
        assert err == f'{what}write {right}, or ./{out} for a local folder of that name\n'
    else:
        assert err == (f'{what}only s3://bucket/prefix is supported as a remote output: for another store '
                       f'convert to a local directory, then copy it (write ./{out} for a local folder of '
                       f'that name)\n')
    assert os.listdir(tmp_path) == []


def test_keep_local_that_looks_like_a_url_is_refused(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, err = convert(capsys, 'pretrain', ARXIV, '--out', 's3://bucket/x', '--keep-local', 's3:/bucket/x')
    assert rc == 2 and '--keep-local s3:/bucket/x: looks like a mistyped URL' in err, err
    assert os.listdir(tmp_path) == []


def test_dot_slash_folder_with_a_colon_is_local(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, err = convert(capsys, 'pretrain', ARXIV, '--out', './s3:/x', '--max-seq-len', '256')
    assert rc == 0, err
    assert Manifest.read(str(tmp_path / 's3:' / 'x')).counts.rows > 0
