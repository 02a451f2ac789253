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

The core (``api.py``, the foundation modules and config, format, tokenizer, s3, convert, plan,
loader) knows no trainer: it imports nothing from ``train/`` (nor the integrations, tools or
CLI above it) and does not name Composer, not even in a comment.
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
#: the core: what a loop without the trainer uses
CORE = ('api.py', 'errors.py', 'heap.py', 'claims.py', 'config', 'format', 'tokenizer.py', 's3', 'convert',
        'plan', 'loader')


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


def _core_modules() -> list[Path]:
    return [p for p in _modules() if p.relative_to(PACKAGE).parts[0] in CORE]


def test_the_core_imports_no_trainer():
    core = _core_modules()
    assert {p.relative_to(PACKAGE).parts[0] for p in core} == set(CORE)  # every part was walked
    bad = [f'{p.relative_to(PACKAGE)}:{line} imports {module}' for p in core
           for line, module in _imports(p) if _unit(module) in ('train', 'integrations', 'tools', 'cli')]
    assert not bad, '\n'.join(bad)
    # and the check sees such an import where there is one
    assert any(_unit(m) == 'train' for _, m in _imports(PACKAGE / 'tools' / 'plan.py'))


def test_the_core_does_not_name_composer():
    bad = [f'{p.relative_to(PACKAGE)}:{i}: {line.strip()}' for p in _core_modules()
           for i, line in enumerate(p.read_text(encoding='utf-8').splitlines(), 1)
           if 'composer' in line.lower()]
    assert not bad, '\n'.join(bad)
    # and the search finds the name where it is
    assert 'composer' in (PACKAGE / 'train' / 'builder.py').read_text(encoding='utf-8').lower()


#: the most lines a module of the package may have (issue 51): a longer one holds two concerns
MODULE_LINES = 400


def test_no_module_is_over_400_lines():
    sizes = {str(p.relative_to(PACKAGE)): len(p.read_text(encoding='utf-8').splitlines()) for p in _modules()}
    assert not {p: n for p, n in sizes.items() if n > MODULE_LINES}
    assert max(sizes.values()) > MODULE_LINES // 2  # every module was read


def test_test_modules_import_no_test_module():
    bad = [f'{path.relative_to(ROOT)}:{line} imports {module}'
           for path in sorted((ROOT / 'tests').rglob('*.py'))
           for line, module in _imports(path) if module.split('.')[0].startswith('test_')]
    assert not bad, '\n'.join(bad)


#: the third-party packages a function may import: optional extras, or slow to import where most
#: commands never use them (torch and transformers: a ``foundrymix plan`` of a data-only YAML imports
#: neither; omegaconf/yaml: ``config`` is imported by every module, a YAML is read by few; rich, tqdm,
#: matplotlib: output of a few commands). Every other import is at module level.
DEFERRED = {'torch', 'transformers', 'tokenizers', 'sentencepiece', 'safetensors', 'composer', 'peft',
            'accelerate', 'ray', 'boto3', 'botocore', 'datasets', 'pyarrow', 'streaming', 'matplotlib',
            'wandb', 'mlflow', 'tensorboard', 'huggingface_hub', 'jinja2', 'omegaconf', 'yaml', 'rich', 'tqdm',
            'torchao'}  # torchao: the optional fp8 extra, imported only for precision: amp_fp8
#: function-level imports of foundrymix modules that defer none of DEFERRED: (importer, imported) -> why
LATE_ALLOWED = {
    ('foundrymix', 'foundrymix.loader.mixer'): 'the facade: every module imports the package first',
    ('foundrymix', 'foundrymix.api'): 'the facade: every module imports the package first',
}
#: the modules the CLI imports to build its parser (``cli.SUBCOMMAND_MODULES``, and the migrate
#: command's rules): what a command runs is imported when it runs, so each command starts with
#: only the parsers loaded (``foundrymix plan`` of a data-only YAML loads no trainer module)
COMMAND_MODULES = {*ast.literal_eval(ast.unparse(next(
    n.value for n in ast.parse((PACKAGE / 'cli.py').read_text(encoding='utf-8')).body
    if isinstance(n, ast.Assign) and n.targets[0].id == 'SUBCOMMAND_MODULES'))), 'foundrymix.tools.migrate_keys'}


def _graph() -> dict[str, list[tuple[int, str, bool]]]:
    """Module -> (line, imported module, in a function) for every import of the package;
    ``from a import b`` names ``a.b`` where that is a module; ``if TYPE_CHECKING:`` is skipped."""
    names = {'.'.join(('foundrymix',) + p.relative_to(PACKAGE).with_suffix('').parts).removesuffix('.__init__'): p
             for p in _modules()}
    graph = {}
    for name, path in names.items():
        tree, skip, late, out = ast.parse(path.read_text(encoding='utf-8')), set(), set(), []
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and 'TYPE_CHECKING' in ast.unparse(node.test):
                skip |= {id(n) for n in ast.walk(node)}
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                late |= {id(n) for n in ast.walk(node)}
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                out += [(node.lineno, a.name, id(node) in late) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f'{path}:{node.lineno}: a relative import'
                out += [(node.lineno, f'{node.module}.{a.name}' if f'{node.module}.{a.name}' in names
                         else node.module, id(node) in late) for a in node.names]
        graph[name] = list(dict.fromkeys(out))  # ``from a import b, c``: one import of ``a``
    return graph


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index, low, stack, out = {}, {}, [], []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(part) > 1:
                out.append(sorted(part))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    """Function-level imports count too: a circle hidden in a function is still one."""
    graph = _graph()
    edges = {m: {t for _, t, _ in imports if t in graph and t != m} for m, imports in graph.items()}
    assert not _circles(edges), _circles(edges)
    assert _circles({'a': {'b'}, 'b': {'c'}, 'c': {'a', 'd'}, 'd': set()}) == [['a', 'b', 'c']]


def _loaded(graph: dict[str, list[tuple[int, str, bool]]], *start: str) -> set[str]:
    """What importing ``start`` loads: module-level imports, transitively, with the packages above
    each module (third-party ones by their full name)."""
    seen, todo = set(start), list(start)
    while todo:
        m = todo.pop()
        parents = ['.'.join(m.split('.')[:i]) for i in range(1, m.count('.') + 1)]
        for t in [t for _, t, late in graph.get(m, ()) if not late] + [p for p in parents if p in graph]:
            if t not in seen:
                seen.add(t)
                todo.append(t)
    return seen


def _loads(graph: dict[str, list[tuple[int, str, bool]]]) -> dict[str, set[str]]:
    """Module -> the DEFERRED packages importing it loads."""
    return {m: {t.split('.')[0] for t in _loaded(graph, m)} & DEFERRED for m in graph}


def test_a_function_level_import_only_defers_a_heavy_package():
    """A foundrymix module imported in a function must load a DEFERRED package its importer
    does not, or be imported by a command module and not loaded at the CLI's start, or be in
    LATE_ALLOWED; a third-party one must be in DEFERRED."""
    graph = _graph()
    loads = _loads(graph)
    start = _loaded(graph, 'foundrymix.cli', *COMMAND_MODULES)
    bad = []
    for m, imports in sorted(graph.items()):
        for line, t, late in imports:
            if not late or t == m:
                continue
            if t.split('.')[0] == 'foundrymix':
                if t in graph and not loads[t] - loads[m] and (m, t) not in LATE_ALLOWED \
                        and (m not in COMMAND_MODULES or t in start):
                    bad.append(f'{m}:{line} imports {t} in a function, deferring nothing heavy')
            elif t.split('.')[0] not in DEFERRED:
                bad.append(f'{m}:{line} imports {t} in a function; import it at module level')
    assert not bad, f'{len(bad)}:\n' + '\n'.join(bad)
    # the rule sees what is deferred: the loader's torch, the trainer's Composer; the plan has neither
    assert 'torch' in loads['foundrymix.loader.run_loader'] and 'composer' in loads['foundrymix.train.builder']
    assert not loads['foundrymix.tools.plan'] & {'torch', 'transformers'}
    assert {'foundrymix.tools.plan', 'foundrymix.convert.cli'} <= COMMAND_MODULES <= set(graph)
    assert 'foundrymix.train.config' not in start and 'foundrymix.loader.run_loader' not in start
