"""The one config layer: YAML loading (omegaconf: ``${variables.x}``, ``key=value`` overrides),
a strict typed reader (``ConfigError`` lives in :mod:`foundrymix.errors`), duration parsing.

Why strict: a misspelt key silently dropped trains the wrong mixture for days. Every section is a
dataclass; :func:`read_dataclass` checks every annotation, names the full key path and reports
every problem at once. Imports no torch and no trainer, so ``foundrymix plan`` stays fast.
"""

from __future__ import annotations

from foundrymix.errors import (FOUNDRY_RENAMES, ConfigError, ConfigErrors, Gather, check_keys,  # noqa: F401
                               did_you_mean, errors_of, foundry_advice, join)
from foundrymix.config.loading import OVERRIDES_HELP, blame, load_yaml, load_yaml_overrides, to_plain  # noqa: F401
from foundrymix.config.reader import (DERIVED, FROM_KEY, TableEntry, number_abbrev_to_int,  # noqa: F401
                                      read_dataclass, read_table, read_value)
from foundrymix.config.durations import (DURATION_UNITS, INTERVAL_UNITS, SPAN_UNITS, UNIT_WORDS,  # noqa: F401
                                         Duration, Interval, parse_time, to_batches)
