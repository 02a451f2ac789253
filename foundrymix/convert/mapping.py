"""Field mapping at conversion: templates over a record's fields and ``--preprocess``.

A template builds a field from others: ``--response ' {endings[label]}'``. Inside ``{}``: ``name``,
``.key``, ``[3]`` (negative from the end), ``[other]`` (index or key = field ``other``'s value);
values are strings or numbers; ``{{ }}`` are braces. Resolved here, not by ``str.format``, which
would reach Python internals (``{x.__class__}``). ``--preprocess module:function`` runs first on
every record: a dict, or ``None`` (skipped, counted as :data:`PREPROCESS_SKIPPED`).

A chat (a ``messages`` list of ``{role, content}``) becomes text segments with loss flags: an
assistant turn is what ``messages[:i+1]`` adds to ``messages[:i]`` rendered with the chat
template's generation prompt: the header is not trained, the end marker is. Without a template a
message is ``"{role}: "`` (no loss) then ``"{content}\\n"``. Bad records: an unknown role, a chat
not opening with a system or user message, a chat the template refuses.

Texts are tokenized through the Rust batch encoder, huge texts in slices with bounded memory: a
text over ``SLICE_CHARS`` is encoded in slices cut before a single space between non-spaces, where
pre-tokenizers split anyway; how the space is kept is calibrated per tokenizer (:func:`slice_mode`),
which is never sliced if neither way gives the whole-text tokens.
"""

from __future__ import annotations

import importlib
import itertools
import os
import re
import string
import sys
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Optional

import numpy as np

from foundrymix.convert.readers import BadRecord, fields_of, get_string, type_name
from foundrymix.errors import FoundrymixError, UserError

_NAME = r'[A-Za-z_][A-Za-z0-9_\-]*'
_FIELD = re.compile(rf'({_NAME})((?:\.{_NAME}|\[-?\d+\]|\[{_NAME}\])*)$')
_STEP = re.compile(rf'\.({_NAME})|\[(-?\d+)\]|\[({_NAME})\]')

#: the manifest's ``dropped`` key for records a preprocess function returned None for
PREPROCESS_SKIPPED = 'preprocess_skipped'


class TemplateError(FoundrymixError, ValueError):
    """A template that cannot be parsed (raised before any work starts)."""


@dataclass(frozen=True)
class FieldRef:
    """A parsed ``{...}``: its text, top-level name and the ``(kind, value)`` steps after it: key
    (``.k``), index (``[3]``) or field (``[f]``)."""

    text: str
    name: str
    steps: tuple[tuple[str, Any], ...]

    def fields(self) -> set[str]:
        """Top-level fields this reference reads (for columnar inputs)."""
        return {self.name} | {value for kind, value in self.steps if kind == 'field'}


def parse_field(text: str, template: str, option: str) -> FieldRef:
    m = _FIELD.match(text)
    if not m:
        raise TemplateError(f"{option} {template!r}: bad field {{{text}}}: use name, name.key, "
                            f"name[0] or name[other_field]")
    steps = []
    for key, index, field in _STEP.findall(m.group(2)):
        steps.append(('key', key) if key else ('index', int(index)) if index else ('field', field))
    return FieldRef(text, m.group(1), tuple(steps))


@dataclass(frozen=True)
class Template:
    """A parsed template: literal text and field references, alternating."""

    source: str
    option: str  # the command-line option, for messages
    parts: tuple[str | FieldRef, ...]

    @classmethod
    def parse(cls, source: str, option: str) -> 'Template':
        try:
            pieces = list(string.Formatter().parse(source))
        except ValueError as e:
            raise TemplateError(f'{option} {source!r}: {e}') from None
        parts: list[str | FieldRef] = []
        for literal, field, spec, conversion in pieces:
            if literal:
                parts.append(literal)
            if field is None:
                continue
            if spec or conversion:
                raise TemplateError(f'{option} {source!r}: format specs and conversions are not '
                                    f'supported ({{{field}{"!" + conversion if conversion else ""}'
                                    f'{":" + spec if spec else ""}}})')
            if not field:
                raise TemplateError(f'{option} {source!r}: empty field {{}}: name a field')
            parts.append(parse_field(field, source, option))
        return cls(source, option, tuple(parts))

    def fields(self) -> set[str]:
        return set().union(*(p.fields() for p in self.parts if isinstance(p, FieldRef)))

    def render(self, rec: dict) -> str | BadRecord:
        """The template filled from ``rec``, or why it cannot be (naming the field)."""
        out = []
        for part in self.parts:
            if isinstance(part, str):
                out.append(part)
                continue
            value = resolve(rec, part)
            if isinstance(value, BadRecord):
                return BadRecord(value.reason, f'{self.option} {self.source!r}: {value.detail}')
            out.append(value)
        return ''.join(out)


def _missing(ref: FieldRef, what: str, have: dict) -> BadRecord:
    return BadRecord('missing_field', f"field '{ref.text}': {what} missing (has: {fields_of(have)})")


def resolve(rec: dict, ref: FieldRef) -> str | BadRecord:
    """The string value of ``ref`` in ``rec`` (see the module docstring for the syntax)."""
    if ref.name not in rec:
        return _missing(ref, f"'{ref.name}'", rec)
    value, path = rec[ref.name], ref.name
    for kind, key in ref.steps:
        if kind == 'field':
            if key not in rec:
                return _missing(ref, f"index field '{key}'", rec)
            key = rec[key]
            if isinstance(value, list) and isinstance(key, str) and re.fullmatch(r'-?\d+', key):
                key = int(key)
        if isinstance(value, dict):
            if not isinstance(key, str) or key not in value:
                return _missing(ref, f'key {key!r} of {path}', value)
            value = value[key]
        elif isinstance(value, list):
            if not isinstance(key, int) or isinstance(key, bool):
                return BadRecord('bad_index', f"field '{ref.text}': {path} is a list, index {key!r} "
                                              f'is not an integer')
            if not -len(value) <= key < len(value):
                return BadRecord('bad_index', f"field '{ref.text}': index {key} out of range "
                                              f'({path} has {len(value)} items)')
            value = value[key]
        else:
            return BadRecord('bad_index', f"field '{ref.text}': {path} is {type_name(value)}, "
                                          f'cannot index it with {key!r}')
        path = f'{path}[{key!r}]'
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return BadRecord('not_string', f"field '{ref.text}': expected a string or number, got "
                                       f'{type_name(value)}')
    return value if isinstance(value, str) else str(value)


@lru_cache(maxsize=None)
def parse_template(source: Optional[str], option: str) -> Optional[Template]:
    """The parsed template (cached: workers call this per chunk), ``None`` for ``None``."""
    return None if source is None else Template.parse(source, option)


@lru_cache(maxsize=None)
def load_preprocess(spec: str) -> Callable[[dict], Any]:
    """Import ``module:function`` (the current directory first on ``sys.path``); errors name it."""
    module_name, sep, func_name = spec.partition(':')
    if not sep or not module_name or not func_name:
        raise UserError(f"--preprocess {spec!r}: expected module:function, e.g. my_prep:to_prompt")
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UserError(f'--preprocess {spec!r}: cannot import module {module_name!r}: {e}') from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise UserError(f'--preprocess {spec!r}: module {module_name!r} has no function {func_name!r}')
    return func


def read_fields(named: tuple[str, ...], templates: tuple[Optional[Template], ...],
                preprocess: Optional[str]) -> Optional[tuple[str, ...]]:
    """Top-level fields to read from columnar inputs: all (``None``) for a preprocess
    function, else the ``named`` ones and those the templates use."""
    if preprocess is not None:
        return None
    used = set().union(*(t.fields() for t in templates if t is not None))
    return tuple(dict.fromkeys([*named, *sorted(used)]))


def apply_preprocess(spec: str, rec: dict) -> dict | None | BadRecord:
    """``spec``'s function on ``rec``: a dict, ``None`` (skip), or why it failed (naming it)."""
    try:
        out = load_preprocess(spec)(rec)
    except Exception as e:  # noqa: BLE001 -- any failure of user code is a bad record
        return BadRecord('preprocess_error', f'--preprocess {spec}: {type(e).__name__}: {e}')
    if out is not None and not isinstance(out, dict):
        return BadRecord('preprocess_error', f'--preprocess {spec}: returned {type_name(out)}, '
                                             f'expected a dict or None')
    return out


#: roles every chat template handles (see :func:`allowed_roles`)
CHAT_ROLES = ('system', 'user', 'assistant')

Segments = list[tuple[str, bool]]  # (text, has loss)


def chat_segments(messages: Any, field: str, chat_loss: str, loss_on_prompt: bool,
                  tok: Any) -> Segments | BadRecord:
    """The segments of one chat, or why it is unusable (a :class:`BadRecord`)."""
    f = field
    if not isinstance(messages, list) or not messages:
        return BadRecord('not_string' if not isinstance(messages, list) else 'empty_document',
                         f"field '{f}': expected a non-empty list of messages, got "
                         f"{type_name(messages) if not isinstance(messages, list) else 'an empty list'}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return BadRecord('not_string', f"field '{f}[{i}]': expected an object, got {type_name(m)}")
        for key in ('role', 'content'):
            value = get_string(m, key)
            if isinstance(value, BadRecord):
                return BadRecord(value.reason, f"field '{f}[{i}].{key}': {value.detail.split(': ', 1)[1]}")
    allowed = allowed_roles(tok)
    for m in messages:
        if m['role'] not in allowed:
            return BadRecord('unknown_role', f"field '{f}': unknown role {m['role']!r} "
                                             f"(allowed: {', '.join(allowed)})")
    if messages[0]['role'] == 'assistant':
        return BadRecord('assistant_first', f"field '{f}[0]': the chat starts with an assistant message; "
                                            f"a chat starts with a system or user message (the prompt "
                                            f"its first reply answers)")
    assistant = [i for i, m in enumerate(messages) if m['role'] == 'assistant']
    if not assistant:
        return BadRecord('no_assistant', f"field '{f}': no assistant message")
    trained = set(assistant if chat_loss == 'all' else assistant[-1:])
    if tok.chat_template is None:
        segs: Segments = []
        for i, m in enumerate(messages):
            segs += [(f"{m['role']}: ", loss_on_prompt),
                     (m['content'] + '\n', loss_on_prompt or i in trained)]
        return segs
    from jinja2 import TemplateError
    try:
        return _template_segments(messages, trained, loss_on_prompt, tok)
    except TemplateError as e:
        return BadRecord('template_error', f"field '{f}': the tokenizer's chat template refused this chat: {e}")


def allowed_roles(tok: Any) -> tuple[str, ...]:
    """Roles a chat may use: system, user and assistant, plus tool where the template names
    it or the plain template is used. A misspelt role (``USER``, ``Assistant``) would render
    as unintended text or silently drop the turn from the loss."""
    template = tok.chat_template
    if template is None or re.search(r"""['"]tool['"]""", str(template)):
        return CHAT_ROLES + ('tool',)
    return CHAT_ROLES


def _template_segments(messages: list[dict], trained: set[int], loss_on_prompt: bool,
                       tok: Any) -> Segments:
    def render(msgs: list[dict], gen: bool) -> str:
        return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    segs: Segments = []
    done = ''
    for i, m in enumerate(messages):
        assistant = m['role'] == 'assistant'  # its header (the generation prompt) is a segment of its own
        head = render(messages[:i], True) if assistant else done
        full = render(messages[:i + 1], False)
        if not head.startswith(done) or not full.startswith(head):
            raise UserError('chat template is not prefix-stable; cannot locate assistant turns')
        if assistant:
            segs.append((head[len(done):], loss_on_prompt))
        segs.append((full[len(head):], loss_on_prompt or i in trained))  # only assistant turns are trained
        done = full
    return segs


#: texts longer than this many characters are tokenized in slices of about this size
SLICE_CHARS = 1 << 20
#: a safe cut: just before a single space between two non-whitespace characters
_CUT = re.compile(r'(?<=\S) (?=\S)')
#: word pairs that calibrate :func:`slice_mode`
_PROBES = (('hello', 'world'), ('The', 'cat sat.'), ('x=1,', '(y)'), ('über', 'naïve'))


def _batch_encoder(tok: Any) -> Any:
    """``encode_batch_fast`` (tokenizers >= 0.20) skips offset tracking, which we do not use."""
    backend = tok.backend_tokenizer
    return getattr(backend, 'encode_batch_fast', backend.encode_batch)


def encode_texts(tok: Any, texts: list[str],
                 slice_chars: int = SLICE_CHARS) -> list[list[int] | np.ndarray]:
    """Token ids of each text, without special tokens: lists of ints, or ``uint32`` arrays for
    texts over ``slice_chars`` (encoded in slices)."""
    out: list[Any] = [encode_long(tok, t, slice_chars) if len(t) > slice_chars else None for t in texts]
    short = [i for i, x in enumerate(out) if x is None]
    for i, e in zip(short, _batch_encoder(tok)([texts[i] for i in short], add_special_tokens=False)):
        out[i] = e.ids
    return out


def encode_long(tok: Any, text: str, slice_chars: int = SLICE_CHARS) -> np.ndarray:
    """Ids of one long text as ``uint32``, encoded in slices of about ``slice_chars``."""
    encode = _batch_encoder(tok)
    mode = slice_mode(tok)
    parts: list[np.ndarray] = []
    start = 0
    while start < len(text):
        cut = _CUT.search(text, start + slice_chars) if mode is not None else None  # None past the end
        end = len(text) if cut is None else cut.start()
        piece = encode([text[start:end]], add_special_tokens=False)[0].ids
        parts.append(np.asarray(piece, dtype=np.uint32))
        del piece
        start = end + (1 if cut is not None and mode == 'drop_space' else 0)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)


def concat_ids(parts: list[list[int] | np.ndarray], dtype: str) -> np.ndarray:
    """``parts`` (ids as :func:`encode_texts` gives them, separator lists) back to back as one
    ``dtype`` array; each run of lists is converted in one C call."""
    pieces: list[np.ndarray] = []
    for is_list, run in itertools.groupby(parts, key=lambda p: type(p) is list):
        pieces += [np.fromiter(itertools.chain.from_iterable(run), dtype=dtype)] if is_list else list(run)
    return np.concatenate(pieces, dtype=dtype) if pieces else np.zeros(0, dtype=dtype)


@lru_cache(maxsize=8)  # per tokenizer object, as many as load_tokenizer keeps
def slice_mode(tok: Any) -> Optional[str]:
    """How the slice after a cut must start for sliced tokens to equal whole-text tokens:
    ``'keep_space'`` (``" next..."``), ``'drop_space'`` (``"next..."``), or ``None``
    (slicing changes tokens: do not slice). Calibrated once per tokenizer object."""
    def ids(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in _batch_encoder(tok)(texts, add_special_tokens=False)]

    wholes, heads = ids([f'{a} {b}' for a, b in _PROBES]), ids([a for a, _ in _PROBES])
    for mode, space in (('keep_space', ' '), ('drop_space', '')):
        if all(h + t == w for h, t, w in zip(heads, ids([space + b for _, b in _PROBES]), wholes)):
            return mode
    return None
