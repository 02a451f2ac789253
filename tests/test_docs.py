"""Every fenced code block in README.md and docs/*.md is run, or checked against its source.

Why: the README was a 45 KB reference whose examples drifted from the code (a `train_loader`
that mixed `repeat` and `proportion`, which the loader refuses; a plan excerpt cut off;
timings a run contradicted). Now each block carries an HTML comment right before it that
says how it is checked, and a block without one fails:

* ``<!-- from: PATH -->`` -- every non-blank line of the block appears verbatim in PATH;
* ``<!-- output of: COMMAND -->`` -- COMMAND (``foundrymix ...``) is run against the bundled
  samples converted as the demo does, and every non-blank line of the block appears in its
  output (``--help`` is rendered in-process at 100 columns);
* ``<!-- run -->`` -- bash: each ``foundrymix ...``/``python ...`` line runs (exit 0) in a fresh
  directory that sees the repository's ``yamls/``, ``data/`` and ``train.py`` (and the demo's
  converted data unless the block converts it itself); YAML: read by the typed config
  reader as ``train``/``plan`` read it (a partial YAML replaces those top-level sections of
  ``yamls/demo.yaml``), so a stale key or a refused weighting fails; python: run as a script
  in such a directory;
* ``<!-- example, not run: WHY -->`` -- needs what a test machine lacks (a bucket, a
  cluster, GPUs, minutes of training); still, every ``foundrymix`` line must parse with the
  real argument parser, every ``train.py`` line's YAML must load with its overrides, every
  ``bash FILE`` must exist, and YAML is read as for ``run``;
* ``<!-- example output, not checked: WHY -->`` -- console output another test checks;
* ``<!-- layout -->`` -- the code layout: every path it lists exists and every module of
  the package is named in it.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from helpers import DEMO_TOKENIZER, ROOT, SAMPLES

PAGES = [ROOT / 'README.md', *sorted((ROOT / 'docs').glob('*.md'))]
MARKER = re.compile(r'^<!--\s*(?P<kind>from|output of|run|example, not run|example output, not checked|layout)'
                    r'\s*:?\s*(?P<arg>.*?)\s*-->$')
#: placeholder paths in YAML examples -> made real by the test
MODEL_DIR_PLACEHOLDER = '/models/my-llama'
COLUMNS = '100'


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    body: str
    kind: str | None
    arg: str

    @property
    def id(self) -> str:
        return f'{self.page.relative_to(ROOT)}:{self.line}'


def extract_blocks(path: Path) -> list[Block]:
    """Fenced blocks of a Markdown file with the marker comment on the last non-blank line
    before each (None when there is none)."""
    lines = path.read_text(encoding='utf-8').splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].startswith('```'):
            lang = lines[i][3:].strip()
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith('```'))
            prev = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), '')
            m = MARKER.match(prev)
            blocks.append(Block(path, i + 1, lang, '\n'.join(lines[i + 1:end]),
                                m['kind'] if m else None, m['arg'] if m else ''))
            i = end + 1
        else:
            i += 1
    return blocks


BLOCKS = [b for page in PAGES for b in extract_blocks(page)]


def _slow(block: Block) -> bool:
    """Bash blocks that convert (~20 s for the two samples at load 3) or train."""
    return block.kind == 'run' and block.lang == 'bash' and ('train.py' in block.body
                                                             or 'foundrymix convert' in block.body)


def _params(kinds: tuple[str, ...]) -> list:
    return [pytest.param(b, id=b.id, marks=[pytest.mark.slow] if _slow(b) else [])
            for b in BLOCKS if b.kind in kinds]


def commands(body: str) -> list[list[str]]:
    """Shell lines of a bash block (continuations joined, comments dropped), split."""
    text = re.sub(r'\\\n\s*', ' ', body)
    out = []
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        if words:
            out.append(words)
    return out


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope='session')
def demo_data(tmp_path_factory) -> Path:
    """``out/demo/data/{arxiv,dolly}`` converted from the bundled samples as the demo does."""
    from foundrymix.convert.finetune import FinetuneOptions, convert_finetune
    from foundrymix.convert.pretrain import PretrainOptions, convert_pretrain

    data = tmp_path_factory.mktemp('docs-data') / 'out' / 'demo' / 'data'
    convert_pretrain([str(SAMPLES / 'arxiv_sample.jsonl')], str(data / 'arxiv'),
                     PretrainOptions(max_seq_len=256, tokenizer=DEMO_TOKENIZER))
    convert_finetune([str(SAMPLES / 'dolly_hhrlhf_sample.jsonl')], str(data / 'dolly'),
                     FinetuneOptions(max_seq_len=256, tokenizer=DEMO_TOKENIZER))
    return data


def workdir(tmp_path: Path, data: Path | None) -> Path:
    """A directory that looks like the repository root to a command (its own ``out/``)."""
    for name in ('yamls', 'data', 'train.py', 'scripts'):
        (tmp_path / name).symlink_to(ROOT / name)
    if data is not None:
        shutil.copytree(data, tmp_path / 'out' / 'demo' / 'data')
    return tmp_path


def env() -> dict[str, str]:
    return {**os.environ, 'PYTHONPATH': str(ROOT), 'COLUMNS': COLUMNS, 'HF_HUB_OFFLINE': '1',
            'TRANSFORMERS_OFFLINE': '1', 'TOKENIZERS_PARALLELISM': 'false'}


def argv(words: list[str]) -> list[str] | None:
    """The real process for a ``foundrymix``/``python`` line, or None for other lines."""
    if words[0] == 'foundrymix':
        return [sys.executable, '-m', 'foundrymix.cli', *words[1:]]
    if words[0] == 'python':
        return [sys.executable, *words[1:]]
    return None


def run_line(words: list[str], cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv(words), cwd=cwd, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f'{shlex.join(words)} -> exit {proc.returncode}\n{proc.stderr[-3000:]}'
    return proc


# ---------------------------------------------------------------------------- checks
def read_yaml_block(text: str, tmp_path: Path) -> None:
    """Read a YAML example as ``train`` reads a config: a whole one as it is, a partial one
    in place of those sections of ``yamls/demo.yaml``."""
    from foundrymix.config import load_yaml
    from foundrymix.train.config import TrainConfig

    if MODEL_DIR_PLACEHOLDER in text:
        model_dir = tmp_path / 'my-llama'
        model_dir.mkdir()
        (model_dir / 'config.json').write_text('{"model_type": "llama"}')
        text = text.replace(MODEL_DIR_PLACEHOLDER, str(model_dir))
    doc = yaml.safe_load(text)
    assert isinstance(doc, dict), 'a YAML example is a mapping of config keys'
    cfg = load_yaml(str(ROOT / 'yamls' / 'demo.yaml'))
    cfg.update(doc)
    if (doc.get('train_loader') or {}).get('stages') is not None and 'max_duration' not in doc:
        cfg.pop('max_duration')  # the run is the sum of its stages
    TrainConfig.from_dict(cfg)


def check_example_commands(body: str) -> None:
    from foundrymix.cli import build_parser
    from foundrymix.train.config import load_config

    for words in commands(body):
        if words[0] == 'foundrymix':
            with contextlib.redirect_stderr(io.StringIO()) as err:
                try:
                    build_parser().parse_args(words[1:])
                except SystemExit:
                    pytest.fail(f'{shlex.join(words)}: {err.getvalue().strip()}')
        if 'train.py' in words or words[:2] == ['foundrymix', 'train']:
            rest = words[words.index('train.py') + 1:] if 'train.py' in words else words[2:]
            if (ROOT / rest[0]).is_file():  # else a user's file, e.g. the YAML shown beside it
                load_config(str(ROOT / rest[0]), rest[1:])
        if words[0] == 'bash':
            assert (ROOT / words[1]).is_file(), f'{words[1]}: no such file'


def help_text(words: list[str], monkeypatch) -> str:
    from foundrymix.cli import build_parser
    monkeypatch.setenv('COLUMNS', COLUMNS)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args(words[1:])
    return out.getvalue()


def assert_lines_in(block: Block, text: str, where: str, strip: bool = False) -> None:
    have = {(ln.strip() if strip else ln.rstrip()) for ln in text.splitlines()}
    missing = [ln for ln in block.body.splitlines()
               if ln.strip() and (ln.strip() if strip else ln.rstrip()) not in have]
    assert not missing, f'{block.id}: lines not in {where}:\n' + '\n'.join(missing)


# ---------------------------------------------------------------------------- tests
def test_every_block_is_marked():
    unmarked = [b.id for b in BLOCKS if b.kind is None]
    assert not unmarked, f'code blocks without a <!-- from|output of|run|example... --> marker: {unmarked}'
    reasonless = [b.id for b in BLOCKS if b.kind in ('example, not run', 'example output, not checked')
                  and not b.arg]
    assert not reasonless, f'examples not run must say why: {reasonless}'
    assert len(BLOCKS) >= 20  # the pages have their blocks (the extractor found them)


@pytest.mark.parametrize('block', _params(('from',)))
def test_block_is_copied_from_its_file(block):
    source = ROOT / block.arg
    assert source.is_file(), f'{block.id}: {block.arg}: no such file'
    assert_lines_in(block, source.read_text(encoding='utf-8'), block.arg)


@pytest.mark.parametrize('block', _params(('output of',)))
def test_block_is_the_commands_output(block, demo_data, tmp_path, monkeypatch):
    words = shlex.split(block.arg)
    if '--help' in words:
        assert_lines_in(block, help_text(words, monkeypatch), block.arg)
        return
    proc = run_line(words, workdir(tmp_path, demo_data))
    assert_lines_in(block, proc.stdout + proc.stderr, block.arg, strip=True)


@pytest.mark.parametrize('block', _params(('run',)))
def test_block_runs(block, demo_data, tmp_path):
    if block.lang == 'yaml':
        read_yaml_block(block.body, tmp_path)
    elif block.lang == 'python':
        cwd = workdir(tmp_path, demo_data)
        (cwd / 'example.py').write_text(block.body)
        run_line(['python', 'example.py'], cwd)
    elif block.lang == 'bash':
        lines = [w for w in commands(block.body) if argv(w) is not None]
        assert lines, f'{block.id}: nothing to run'
        converts = any(w[:2] == ['foundrymix', 'convert'] for w in lines)
        cwd = workdir(tmp_path, None if converts else demo_data)
        for words in lines:
            run_line(words, cwd)
    else:
        pytest.fail(f'{block.id}: cannot run a {block.lang!r} block')


@pytest.mark.parametrize('block', _params(('example, not run',)))
def test_example_is_well_formed(block, tmp_path):
    if block.lang == 'yaml':
        read_yaml_block(block.body, tmp_path)
    else:
        assert block.lang == 'bash', f'{block.id}: examples not run are bash or yaml'
        check_example_commands(block.body)


@pytest.mark.parametrize('block', _params(('layout',)))
def test_layout_names_every_module(block):
    listed = [ln.split()[0] for ln in block.body.splitlines() if ln and not ln[0].isspace()]
    missing = [p for p in listed if '/' in p and not (ROOT / p).exists()]
    assert not missing, f'{block.id}: listed but not in the repository: {missing}'
    modules = [p for p in (ROOT / 'foundrymix').rglob('*.py')
               if p.name != '__init__.py' and 'assets' not in p.parts]
    unnamed = [str(p.relative_to(ROOT)) for p in modules
               if str(p.relative_to(ROOT)) not in block.body and p.stem not in block.body]
    assert not unnamed, f'{block.id}: modules the layout does not name: {unnamed}'


def test_the_extractor_sees_markers_and_unmarked_blocks(tmp_path):
    """The check cannot pass vacuously: an unmarked block and each marker are recognised."""
    page = tmp_path / 'p.md'
    page.write_text('text\n\n```bash\nfoundrymix plan x.yaml\n```\n\n<!-- from: yamls/demo.yaml -->\n'
                    '```yaml\nrun_name: demo\n```\n<!-- example, not run: needs S3 -->\n```bash\nls\n```\n')
    got = [(b.line, b.lang, b.kind, b.arg) for b in extract_blocks(page)]
    assert got == [(3, 'bash', None, ''), (8, 'yaml', 'from', 'yamls/demo.yaml'),
                   (12, 'bash', 'example, not run', 'needs S3')]


@pytest.mark.parametrize('page', PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_images_exist(page):
    """Pages moved into docs/: every relative link (and the curriculum picture) resolves."""
    text = page.read_text(encoding='utf-8')
    targets = re.findall(r'\]\((?!https?://)([^)#\s]+)', text)
    missing = [t for t in targets if not (page.parent / t).exists()]
    assert not missing, f'{page.name}: links to missing files: {missing}'


def test_readme_gives_the_two_setup_commands():
    """CI runs "the README's test command" (.ci/run: ``bash scripts/test.sh``) on a fresh clone."""
    quick = next(b for b in extract_blocks(ROOT / 'README.md') if 'scripts/demo.sh' in b.body)
    assert [w[:2] for w in commands(quick.body)] == [['bash', 'scripts/demo.sh'], ['bash', 'scripts/test.sh']]
    assert 'bash scripts/test.sh' in (ROOT / '.ci' / 'run').read_text()
