"""The core (convert, adopt, plan, inspect, verify, migrate, the loader) runs without Composer.

``pip install foundrymix`` installs no Composer; only ``foundrymix/train/`` may import it.
Checked twice: statically (no import of ``composer`` in any module outside
``foundrymix/train/``) and for real, in child processes whose import system refuses
``composer`` (a meta-path finder raising ``ModuleNotFoundError``, as a venv without it
does) and records every attempt: the core commands and ``build_loader`` must not even try. ``foundrymix train``
there stops with one line naming the extra to install.
"""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import yaml
from helpers import DEMO_TOKENIZER, ROOT, SAMPLES, SMALL_SEQ, tiny_run_config
from transformers import LlamaConfig

PACKAGE = ROOT / 'foundrymix'

#: put first in every child: refuse ``composer`` and record who asked for it
BLOCK_COMPOSER = textwrap.dedent('''
    import importlib.abc, sys
    ASKED = []
    class NoComposer(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == 'composer' or name.startswith('composer.'):
                ASKED.append(name)
                raise ModuleNotFoundError(f'No module named {name!r}', name=name)
            return None
    sys.meta_path.insert(0, NoComposer())
    for name in [m for m in sys.modules if m == 'composer' or m.startswith('composer.')]:
        del sys.modules[name]
''')


def _composer_imports(path: Path) -> list[str]:
    """``file:line`` of each import of composer in a module: statements and import_module calls."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding='utf-8'), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, 'id', '')
            if called in ('import_module', '__import__') and isinstance(node.args[0].value, str):
                names = [node.args[0].value]
        if any(n == 'composer' or n.startswith('composer.') for n in names):
            found.append(f'{path.relative_to(ROOT)}:{node.lineno}')
    return found


def test_nothing_outside_train_imports_composer():
    modules = [p for p in sorted(PACKAGE.rglob('*.py')) if (PACKAGE / 'train') not in p.parents]
    assert len(modules) > 40  # the whole package outside train/ was walked
    assert [hit for p in modules for hit in _composer_imports(p)] == []
    # and the check sees an import where there is one
    assert _composer_imports(PACKAGE / 'train' / 'builder.py')


def _child(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, '-c', BLOCK_COMPOSER + textwrap.dedent(code)], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def _data_yaml(tmp_path: Path) -> Path:
    loader = {'streams': {'arxiv': {'local': str(tmp_path / 'arxiv')},
                          'dolly': {'local': str(tmp_path / 'dolly'), 'repeat': 2}},
              'shuffle_seed': 3}
    path = tmp_path / 'run.yaml'
    path.write_text(yaml.safe_dump(tiny_run_config(loader, global_train_batch_size=4, max_duration='6ba')))
    return path


def test_core_commands_and_the_loader_run_with_composer_refused(tmp_path):
    with open(SAMPLES / 'arxiv_sample.jsonl', encoding='utf-8') as f:
        paper = json.loads(f.readline())['text'][:8000]
    (tmp_path / 'paper.jsonl').write_text(json.dumps({'text': paper}) + '\n', encoding='utf-8')
    with open(SAMPLES / 'dolly_hhrlhf_sample.jsonl', encoding='utf-8') as f:
        (tmp_path / 'dolly.jsonl').write_text(''.join(next(f) for _ in range(60)), encoding='utf-8')
    config = _data_yaml(tmp_path)
    # a pretrained directory with the streams' tokenizer: plan checks its vocabulary too, and
    # with a LoRA peft_config builds the model on the meta device to check its target layers
    pretrained = tmp_path / 'pretrained'
    shutil.copytree(PACKAGE / 'assets' / 'tokenizers' / DEMO_TOKENIZER, pretrained)
    (pretrained / 'model.safetensors').touch()
    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, vocab_size=8192, max_position_embeddings=SMALL_SEQ).save_pretrained(pretrained)
    foundry = ROOT / 'tests' / 'data' / 'foundry' / 'mpt-small-cpu.yaml'
    done = _child(f'''
        import contextlib, io, json, torch
        from foundrymix.cli import main
        t, seq = {str(tmp_path)!r}, '{SMALL_SEQ}'
        codes = {{}}
        for name, argv in [
                ('pretrain', ['convert', 'pretrain', t + '/paper.jsonl', '--out', t + '/arxiv', '--max-seq-len', seq]),
                ('finetune', ['convert', 'finetune', t + '/dolly.jsonl', '--out', t + '/dolly', '--max-seq-len', seq]),
                ('inspect', ['inspect', t + '/dolly', '--decode', '1']),
                ('verify', ['verify', t + '/arxiv']),
                ('plan', ['plan', {str(config)!r}]),
                ('plan_pretrained', ['plan', {str(config)!r}, 'model.pretrained=' + t + '/pretrained']),
                ('plan_lora', ['plan', {str(config)!r}, 'model.pretrained=' + t + '/pretrained',
                               'model.peft_config={{r: 2, lora_alpha: 4, target_modules: [q_proj, v_proj]}}']),
                ('migrate', ['migrate', {str(foundry)!r}, '--out', t + '/migrated.yaml'])]:
            with contextlib.redirect_stdout(io.StringIO()) as out:
                codes[name] = main(argv)
            if name == 'verify':
                verdict = [line for line in out.getvalue().splitlines() if line.startswith('verdict:')]

        from foundrymix import build_loader
        cfg = {str(config)!r}
        straight = [b['input_ids'] for b in build_loader(cfg, rank=0, world_size=1)]
        first = build_loader(cfg, rank=0, world_size=1)
        it = iter(first)
        head = [next(it)['input_ids'] for _ in range(2)]
        state = first.state_dict()
        resumed = build_loader(cfg, rank=0, world_size=1)
        resumed.load_state_dict(state)
        tail = [b['input_ids'] for b in resumed]
        print(json.dumps({{'codes': codes, 'verdict': verdict, 'batches': len(straight),
                          'resumed_at': state['batch'], 'equal': [torch.equal(a, b) for a, b in
                                                                  zip(straight, head + tail)],
                          'distinct': len({{tuple(b.flatten().tolist()) for b in straight}}),
                          'asked': ASKED, 'loaded': sorted(m for m in sys.modules if m.startswith('composer'))}}))
    ''', tmp_path)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.splitlines()[-1])
    assert got['codes'] == {'pretrain': 0, 'finetune': 0, 'inspect': 0, 'verify': 0, 'plan': 0,
                            'plan_pretrained': 0, 'plan_lora': 0, 'migrate': 0}
    assert len(got['verdict']) == 1 and got['verdict'][0].startswith('verdict: INTACT')
    # 6 batches straight; stopped after 2 and resumed from the state dict: the same 6, bitwise
    assert (got['batches'], got['resumed_at'], got['equal']) == (6, 2, [True] * 6)
    assert got['distinct'] == 6
    assert got['asked'] == [] and got['loaded'] == []


def test_train_without_composer_names_the_extra_in_one_line(tmp_path):
    (tmp_path / 'arxiv').mkdir()
    (tmp_path / 'dolly').mkdir()
    config = _data_yaml(tmp_path)
    done = _child(f'''
        from foundrymix.cli import main
        raise SystemExit(main(['train', {str(config)!r}]))
    ''', tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "foundrymix train: error: training needs Composer, which is not installed here: pip install "
        "'foundrymix[composer]' (it pins torch <2.7.1 and numpy <2.3; convert, plan and the loader run without it)"]
    assert not (tmp_path / 'runs').exists()


def test_train_reads_the_yaml_before_looking_for_composer(tmp_path):
    config = _data_yaml(tmp_path)
    done = _child(f'''
        from foundrymix.cli import main
        raise SystemExit(main(['train', {str(config)!r}, 'optimizer.lrr=1']))
    ''', tmp_path)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.splitlines()) == 1
    assert 'lrr' in done.stderr and 'composer' not in done.stderr
