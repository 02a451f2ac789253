"""``foundrymix migrate FOUNDRY.yaml [--out NEW.yaml]``: an LLM-Foundry training YAML rewritten in
foundrymix's keys; what has no equivalent is removed and listed, never guessed. The input is only
read; ``--out`` never replaces a file."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any

from foundrymix.config import foundry_advice, load_yaml
from foundrymix.errors import ExistsError
from foundrymix.tools.migrate_keys import DATASET_KEYS, cpu_overrides, kept, model_keys, read_back, show

#: top-level keys renamed one to one
TOP_RENAMES = {'fsdp_config': 'fsdp', 'console_log_interval': 'log_interval', 'global_seed': 'seed'}
#: what a rename's line adds: where the meaning differs
_RENAME_NOTES = {'fsdp_config': " (FSDP runs on GPUs here: a CPU run is refused until fsdp is left out; "
                                "LLM-Foundry dropped it with a warning on one rank)"}
#: LLM-Foundry ``model.name`` -> ``model.type`` (None: the name goes, pretrained_model_name_or_path stays;
#: T5, an encoder-decoder, is then refused as ``plan`` refuses it)
MODEL_NAMES = {'mpt_causal_lm': 'mpt', 'hf_causal_lm': None, 'hf_t5': 't5'}
INTERVALS = ('eval_interval', 'save_interval', 'log_interval')
_REF = re.compile(r'\$\{([A-Za-z_]\w*)\}')
_VAR_REF = re.compile(r'\$\{variables\.([A-Za-z_]\w*)\}')


@dataclass
class Migration:
    data: dict[str, Any]
    changes: list[str] = field(default_factory=list)  # rewritten, same meaning
    dropped: list[str] = field(default_factory=list)  # removed: no equivalent
    todo: list[str] = field(default_factory=list)     # kept: the user must decide
    carried: list[str] = field(default_factory=list)  # kept as is, with a word on what it does here
    original: dict[str, Any] = field(default_factory=dict)  # the input, as read

    def report(self) -> list[str]:
        """Every key of the input, once: kept, changed, removed or to do; then whether the
        migration is complete and, for a GPU YAML, the overrides of a CPU trial."""
        renamed = {new for old, new in TOP_RENAMES.items()
                   if any(c.startswith(f'{old} -> {new}') for c in self.changes)}
        lines = (kept(self, self.original, renamed) + [f'kept: {c}' for c in self.carried]
                 + [f'changed: {c}' for c in self.changes]
                 + [f'removed: {c}' for c in self.dropped] + [f'to do: {c}' for c in self.todo])
        lines.append(f'to do: {len(self.todo)} line(s) above before it runs' if self.todo else
                     'complete: every key is kept, changed or removed as listed')
        cpu = cpu_overrides(self.data)
        if cpu:
            lines.append(f'for a CPU trial add: {" ".join(cpu)}')
        return lines


def _replace_refs(node: Any, old: str, new: str) -> Any:
    if isinstance(node, dict):
        return {k: _replace_refs(v, old, new) for k, v in node.items()}
    if isinstance(node, list):
        return [_replace_refs(v, old, new) for v in node]
    return node.replace('${' + old + '}', '${' + new + '}') if isinstance(node, str) else node


def migrate(data: dict[str, Any], name: str = 'foundrymix') -> Migration:
    """``data`` (a Foundry YAML, interpolations unresolved) in foundrymix's keys; ``name`` (the
    file's) names the run when the YAML leaves ``run_name`` empty."""
    from foundrymix.train.algorithms import ALGORITHMS
    from foundrymix.train.callbacks import CALLBACKS
    from foundrymix.train.config import TrainConfig

    m = Migration(dict(data), original=dict(data))
    d = m.data
    known = {f.name for f in dataclasses.fields(TrainConfig)} | {'variables'}
    # old Foundry: top-level values referenced as ${name} are variables here
    referenced = set(_REF.findall(json.dumps(d)))
    for key in [k for k in d if k not in known and k in referenced]:
        d.setdefault('variables', {})[key] = d.pop(key)
        d.update(_replace_refs(d, key, f'variables.{key}'))
        m.changes.append(f'{key}: moved under variables (${{{key}}} -> ${{variables.{key}}})')
    for old, new in TOP_RENAMES.items():
        if old in d:
            if new in d:
                m.dropped.append(f'{old}: dropped ({new} is set)')
                d.pop(old)
            else:
                d[new] = d.pop(old)
                m.changes.append(f'{old} -> {new}' + _RENAME_NOTES.get(old, ''))
    _run_name(m, name)
    for key in [k for k in d if k != 'variables' and d[k] is None]:  # Foundry: empty = its default
        d.pop(key)
        m.changes.append(f'{key}: empty -> left out (the default applies)')
    variables = d.get('variables') if isinstance(d.get('variables'), dict) else {}
    for key in [k for k in d if k != 'variables' and isinstance(d[k], str)]:
        ref = _VAR_REF.fullmatch(d[key])  # run_name: ${variables.run_name}, that variable empty
        if ref and ref.group(1) in variables and variables[ref.group(1)] is None:
            m.changes.append(f'{key}: {d.pop(key)} is empty -> left out (the default applies)')
    for key in [k for k in d if k not in known]:
        value = d.pop(key)
        merged = [n for n in ('train_loader', 'eval_loader') if _merged_into(value, d.get(n))]
        why = (f'a block the YAML merges into {" and ".join(n + ".dataset" for n in merged)} (<<: *anchor), '
               f'migrated there' if merged else (foundry_advice(key) or 'no equivalent').split('; delete')[0])
        m.dropped.append(f'{key}: {why}')
    if isinstance(d.get('tokenizer'), dict):
        tok = d['tokenizer']
        d['tokenizer'] = tok.get('name')
        m.changes.append(f'tokenizer: {{name: {tok.get("name")}, ...}} -> tokenizer: {tok.get("name")}')
        if tok.get('kwargs'):
            m.dropped.append(f'tokenizer.kwargs ({", ".join(tok["kwargs"])}): no equivalent (max_seq_len '
                             f'and the streams decide)')
    for name in ('train_loader', 'eval_loader'):
        _loader(m, name)
    _model(m)
    for section, table in (('algorithms', ALGORITHMS), ('callbacks', CALLBACKS)):
        for key in [k for k in (d.get(section) or {}) if k not in table]:
            d[section].pop(key)
            m.dropped.append(f'{section}.{key}: no equivalent (here: {", ".join(table)})')
    for key in INTERVALS:  # Composer 0.32's Trainer takes an int interval as epochs; Foundry passes it on
        value = d.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            d[key] = f'{value}ep'
            m.changes.append(f'{key}: {value} -> {value}ep (an int is epochs in Composer, which LLM-Foundry '
                             f'hands it to)')
        elif isinstance(value, float):
            m.todo.append(f'{key}: {value} has no unit: give one (e.g. {value}ep; Composer reads an int as epochs)')
    if d.get('load_weights_only') is True and not d.get('load_path'):
        d.pop('load_weights_only')
        m.dropped.append('load_weights_only: true: no load_path, so no weights to load (LLM-Foundry ignored it)')
    model_keys(m)
    read_back(m)
    return m


def _run_name(m: Migration, name: str) -> None:
    """An empty or absent ``run_name``: LLM-Foundry read ``$RUN_NAME`` or generated a name, so no
    two runs shared one; here the default would name every migrated run ``foundrymix`` and
    each would replace the last one's report. ``$RUN_NAME``, else the YAML file's name."""
    d = m.data
    value = d.get('run_name')
    ref = _VAR_REF.fullmatch(value) if isinstance(value, str) else None
    variables = d.get('variables') if isinstance(d.get('variables'), dict) else {}
    empty = value is None or (ref is not None and ref.group(1) in variables and variables[ref.group(1)] is None)
    if not empty:
        return
    safe = re.sub(r'[^\w.-]', '_', name) or 'foundrymix'
    d['run_name'] = f'${{oc.env:RUN_NAME,{safe}}}'
    was = 'absent' if 'run_name' not in m.original else 'empty' if value is None else f'{value} (empty)'
    m.changes.append(f'run_name: {was} -> {d["run_name"]} (LLM-Foundry: $RUN_NAME, else a generated name; '
                     f'here $RUN_NAME, else {safe}: the run\'s report and {{run_name}} in save_folder follow it, '
                     f'so give each run its own)')


def _merged_into(value: Any, loader: Any) -> bool:
    """Is ``value`` (a top-level block) all in ``loader.dataset``, as ``<<: *anchor`` leaves it?
    (1b_local_data_sft.yaml: ``dataset: &hf_dataset`` only feeds its loaders)."""
    dataset = loader.get('dataset') if isinstance(loader, dict) else None
    return (isinstance(value, dict) and bool(value) and isinstance(dataset, dict)
            and all(k in dataset and dataset[k] == v for k, v in value.items()))


def _loader(m: Migration, name: str) -> None:
    from foundrymix.plan.config import LoaderConfig
    loader = m.data.get(name)
    if isinstance(loader, list):
        m.todo.append(f'{name}: a list of eval loaders; give one eval_loader (streams may be several)')
        return
    if not isinstance(loader, dict):
        return
    if 'name' in loader:
        kind = loader.pop('name')
        m.dropped.append(f'{name}.name: text (its LLM-Foundry token shards are read in place, with the '
                         f'top-level tokenizer; `foundrymix adopt` makes a converted copy)' if kind == 'text' else
                         f"{name}.name: {kind} (each stream's converted format decides)")
    dataset = loader.pop('dataset', None)
    if not isinstance(dataset, dict):
        return
    fields = {f.name for f in dataclasses.fields(LoaderConfig)}
    hf = {k: dataset.pop(k) for k in ('hf_name', 'hf_kwargs', 'preprocessing_fn') if k in dataset}
    if hf:
        stream = name.split('_')[0]
        data_dir = (hf.get('hf_kwargs') or {}).get('data_dir') if isinstance(hf.get('hf_kwargs'), dict) else None
        source = data_dir or f"the {hf.get('hf_name', 'dataset')} files"
        pre = f" --preprocess {hf['preprocessing_fn']}" if hf.get('preprocessing_fn') else ''
        what = ', '.join(f'{k}: {v}' for k, v in hf.items())
        m.todo.append(f'{name}.dataset ({what}): a Hugging Face dataset read at training time; here data '
                      f'is converted once: foundrymix convert finetune {source}{pre} --out DIR (the '
                      f'{dataset.get("split", "train")} split\'s files), then set '
                      f'{name}.streams.{stream}.local: DIR')
    stream = {k: dataset.pop(k) for k in ('local', 'remote', 'split') if k in dataset}
    if hf:  # the Hugging Face split is the one converted (said in the to-do): DIR holds only it
        stream.pop('split', None)
        loader.setdefault('streams', {})[name.split('_')[0]] = {}
    if stream:
        loader.setdefault('streams', {})[name.split('_')[0]] = stream
        m.changes.append(f'{name}.dataset.{{{", ".join(stream)}}} -> {name}.streams.{name.split("_")[0]}')
    from foundrymix.plan.specs import REPLACED_KNOBS, replaced_knob
    for key in [k for k in (*dataset, *loader) if k in REPLACED_KNOBS]:
        value = dataset.pop(key) if key in dataset else loader.pop(key)
        m.dropped.append(f'{name}.{key}: {show(value)}: {replaced_knob(key)}, replaced by '
                         f'foundrymix\'s own order ({REPLACED_KNOBS[key]})')
    if loader.get('persistent_workers') is True:
        loader.pop('persistent_workers')
        m.dropped.append(f'{name}.persistent_workers: true: each span of batches (an epoch, a stage, '
                         f'an evaluation) is read by workers of its own, forked when it starts')
    if name == 'train_loader' and (dataset.get('drop_last') is False or loader.get('drop_last') is False):
        dataset.pop('drop_last', None)
        loader.pop('drop_last', None)
        m.dropped.append(f'{name}.drop_last: false: every training batch is full (an epoch is whole '
                         f'global batches; the rows it cuts go to the next epoch)')
    for key, value in dataset.items():
        if key in fields:
            loader[key] = value
            m.changes.append(f'{name}.dataset.{key} -> {name}.{key}')
        elif key == 'max_seq_len':
            m.dropped.append(f'{name}.dataset.max_seq_len: the top-level max_seq_len says it')
        elif key in DATASET_KEYS:
            m.dropped.append(f'{name}.dataset.{key}: {show(value)}: no equivalent ({DATASET_KEYS[key]})')
        else:
            m.todo.append(f'{name}.dataset.{key}: {show(value)}: no equivalent; removed: check the streams hold '
                          f'what it meant')


def _model(m: Migration) -> None:
    model = m.data.get('model')
    if not isinstance(model, dict) or 'name' not in model:
        return
    name = model.pop('name')
    if name not in MODEL_NAMES:
        m.todo.append(f'model.name: {name}: give model.type, a transformers model_type')
        return
    if MODEL_NAMES[name]:
        model['type'] = MODEL_NAMES[name]
        m.changes.append(f'model.name: {name} -> model.type: {MODEL_NAMES[name]}')
    else:
        m.dropped.append(f'model.name: {name} (pretrained_model_name_or_path says the model)')
    if 'init_device' in model:
        m.dropped.append(f"model.init_device: {model.pop('init_device')}: no equivalent (fsdp builds the model)")
    if 'loss_fn' in model:  # mpt-small-cpu.yaml: torch_crossentropy
        m.dropped.append(f"model.loss_fn: {model.pop('loss_fn')}: no equivalent (the loss is transformers' "
                         f"cross-entropy on the labels)")


def _run(args: argparse.Namespace) -> int:
    import yaml

    data = load_yaml(args.config, resolve=False)
    if args.out and os.path.exists(args.out):
        raise ExistsError(f'--out {args.out}: exists; choose another file (migrate never replaces one)')
    m = migrate(data, os.path.splitext(os.path.basename(args.config))[0])
    report = m.report()
    text = yaml.safe_dump(m.data, sort_keys=False)
    if args.out:
        with open(args.out, 'x', encoding='utf-8') as f:
            f.write(text)
        print('\n'.join(report + [f'wrote {args.out}; check it with: foundrymix plan {args.out}']))
    else:  # the YAML on stdout, the report as its comments
        sys.stdout.write(''.join(f'# {line}\n' for line in report) + text)
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser('migrate', help='rewrite an LLM-Foundry training YAML in foundrymix keys',
                              description='Rewrites an LLM-Foundry training YAML (renamed keys, the '
                                          'loader dataset level, model.name) and lists every change '
                                          'and every setting without an equivalent.')
    p.add_argument('config', help='the LLM-Foundry YAML (only read)')
    p.add_argument('--out', default=None, help='write the new YAML here (default: print it, the report '
                                               'as comments); an existing file is refused')
    p.set_defaults(func=_run)
