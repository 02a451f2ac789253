"""Chat examples (a ``messages`` list of ``{role, content}``) as text segments with loss flags.

An assistant turn is what ``messages[:i+1]`` adds to ``messages[:i]`` rendered with the chat
template's generation prompt: the header is not trained, the end marker is. Without a template a
message is ``"{role}: "`` (no loss) then ``"{content}\\n"``. Bad records: an unknown role, a chat
not opening with a system or user message, a chat the template refuses.
"""

from __future__ import annotations

import re
from typing import Any

from foundrymix.convert.readers import BadRecord, get_string, type_name
from foundrymix.errors import UserError

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
    as unintended text or silently drop the turn from the loss.
    """
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
        if m['role'] == 'assistant':
            head = render(messages[:i], True)
            full = render(messages[:i + 1], False)
            if not head.startswith(done) or not full.startswith(head):
                raise UserError('chat template is not prefix-stable; cannot locate assistant turns')
            segs += [(head[len(done):], loss_on_prompt), (full[len(head):], loss_on_prompt or i in trained)]
        else:
            full = render(messages[:i + 1], False)
            if not full.startswith(done):
                raise UserError('chat template is not prefix-stable; cannot locate assistant turns')
            segs.append((full[len(done):], loss_on_prompt))
        done = full
    return segs
