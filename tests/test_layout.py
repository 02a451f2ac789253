"""The package layout follows the data flow, and nothing imports back up it.

One package per stage of the flow -- ``format`` (the on-disk contract) and ``s3`` below
both sides; ``convert`` on one side; ``plan`` (pure) then ``loader`` (runtime) then
``train`` on the other; ``tools``, ``api`` (the loader for any training loop) and the ``cli`` on top. Every import in the package,
function-level ones included (they are how heavy imports are deferred), must go to a
lower layer or stay in its own package. And streaming's private modules
(``streaming.base.*``) are imported only by the one format module
``format/streaming_format.py`` (MDS hashes, codecs and row reader). In ``tests/``, a test
module imports no other test module: what tests share is in helper modules, so running one
test file never collects or runs another's module-level code.
"""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import ROOT

PACKAGE = ROOT / 'foundrymix'
#: package (or foundation module) -> layer; siblings of one layer may not import each other
#: (``foundrymix/__init__.py`` is the public facade on top: its one import is lazy)
LAYERS = {'errors': 0, 'heap': 0, 'config': 1, 'claims': 1, 'format': 2, 'tokenizer': 3, 's3': 3,
          'convert': 4, 'plan': 4, 'loader': 5, 'train': 6, 'integrations': 6, 'tools': 7, 'api': 7, 'cli': 8, '__init__': 9}
STREAMING_PRIVATE_ALLOWED = {'format/streaming_format.py'}


def _unit(module: str) -> str:
    """``foundrymix.plan.stages`` -> ``plan``; ``foundrymix.config`` -> ``config``."""
    parts = module.split('.')
    return parts[1] if len(parts) > 1 else '__init__'


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding='utf-8'))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            if node.module == 'foundrymix':  # from foundrymix import claims
                out += [(node.lineno, f'foundrymix.{a.name}') for a in node.names]
    return out


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob('*.py'))


def test_every_module_belongs_to_a_layer():
    units = {_unit('foundrymix.' + '.'.join(p.relative_to(PACKAGE).with_suffix('').parts))
             for p in _modules()}
    assert units <= set(LAYERS), sorted(units - set(LAYERS))


def test_no_import_runs_back_up_the_flow():
    bad = []
    for path in _modules():
        rel = path.relative_to(PACKAGE)
        me = _unit('foundrymix.' + '.'.join(rel.with_suffix('').parts))
        for line, module in _imports(path):
            if not module.startswith('foundrymix.'):
                continue
            other = _unit(module)
            if other == me or other == 'StreamMixer':
                continue
            if LAYERS[other] >= LAYERS[me]:
                bad.append(f'{rel}:{line} ({me}, layer {LAYERS[me]}) imports {module} '
                           f'({other}, layer {LAYERS[other]})')
    assert not bad, '\n'.join(bad)


def test_streaming_privates_only_in_the_adapters():
    bad = []
    for path in _modules():
        rel = str(path.relative_to(PACKAGE))
        for line, module in _imports(path):
            if module.startswith('streaming.') and rel not in STREAMING_PRIVATE_ALLOWED:
                bad.append(f'{rel}:{line} imports {module}')
    assert not bad, '\n'.join(bad)


def test_test_modules_import_no_test_module():
    bad = [f'{path.relative_to(ROOT)}:{line} imports {module}'
           for path in sorted((ROOT / 'tests').rglob('*.py'))
           for line, module in _imports(path) if module.split('.')[0].startswith('test_')]
    assert not bad, '\n'.join(bad)
