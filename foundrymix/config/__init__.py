"""The one config layer: YAML loading, a strict typed reader, and the one ``ConfigError``.

Why strict: a misspelt key (``repaet: 2``) silently dropped means a run trains on the
wrong mixture for days, and a value of the wrong type that slips through fails hours
later inside a library. So every config section of foundrymix is a dataclass, and
:func:`read_dataclass` checks *every* annotation it meets (from ``typing.get_type_hints``:
real types, not annotation text), naming the full key path in every error and reporting
every problem of a config at once (docs/train.md).

omegaconf does YAML, ``${variables.x}`` interpolation and ``key=value`` overrides
(:func:`load_yaml`). This package imports no torch and no trainer, so reading a config
(``foundrymix plan``) stays fast. Every public name of :mod:`~foundrymix.config.errors`,
:mod:`~foundrymix.config.loading`, :mod:`~foundrymix.config.reader` and
:mod:`~foundrymix.config.durations` is importable from ``foundrymix.config``.
"""

from __future__ import annotations

from foundrymix.config.errors import (  # noqa: F401
    ConfigError,
    ConfigErrors,
    FOUNDRY_RENAMES,
    Gather,
    check_keys,
    did_you_mean,
    errors_of,
    foundry_advice,
    join)
from foundrymix.config.loading import (  # noqa: F401
    ALIAS_NODE_ALLOWANCE,
    OVERRIDES_HELP,
    Override,
    _omegaconf_load,
    blame,
    load_yaml,
    load_yaml_overrides,
    to_plain)
from foundrymix.config.reader import (  # noqa: F401
    DERIVED,
    FROM_KEY,
    number_abbrev_to_int,
    read_dataclass,
    read_value)
from foundrymix.config.durations import (  # noqa: F401
    DURATION_UNITS,
    INTERVAL_UNITS,
    SPAN_UNITS,
    UNIT_WORDS,
    Duration,
    Interval,
    Time,
    parse_time,
    to_batches)
