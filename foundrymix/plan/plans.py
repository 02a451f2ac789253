"""The plan's results: per stream, per rank and over the duration, and the Plan holding them.
Their fields are the JSON of ``foundrymix plan --json``; :mod:`foundrymix.plan.mixture` fills them."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from foundrymix.plan.exact import EpochWeights


@dataclass
class StreamPlan:
    """One stream's share of every epoch."""

    name: str
    kind: str
    rows: int                  # underlying rows (index.json)
    rows_per_epoch: int        # rows drawn per epoch (the weights, whole global batches)
    passes: float              # rows_per_epoch / rows
    full_passes: int           # every row is seen at least this many times per epoch ...
    rows_seen_extra: int       # ... and this many rows once more (the pass continues next epoch)
    unseen_rows: int           # rows not seen at all in an epoch (passes < 1)
    share: float               # of the rows trained (stratified: of every batch, as rounded)
    trained_rows_per_epoch: int  # rows in full batches of epoch 0 (drop_last / stratified cuts)
    slot_tokens_per_epoch: int   # rows_per_epoch x max_seq_len (what a `tok` duration counts)
    tokens_per_epoch: float      # real (non-padding) tokens; exact iff tokens_exact
    loss_tokens_per_epoch: float
    tokens_exact: bool
    token_share: float = 0.0     # of the epoch's real tokens
    loss_token_share: float = 0.0


@dataclass
class DurationPlan:
    """Where ``max_duration`` ends, in batches, samples, tokens and epochs."""

    max_duration: str
    unit: str
    value: int
    total_batches: int
    total_samples: int
    total_tokens: int          # slot tokens (a `tok` duration's): total_samples x max_seq_len
    epochs: float              # total_batches / batches_per_epoch
    full_epochs: int
    ends_mid_epoch: bool
    last_epoch: int            # 0-based index of the epoch the run stops in (or last finished)
    last_batch_in_epoch: int   # batches of that epoch trained (== batches_per_epoch if not mid)
    last_sample_in_epoch: int  # samples of that epoch trained
    rows_per_stream: Optional[dict[str, int]] = None  # exact rows trained per stream, whole run
    #: always True: every batch is full, so total_samples is exact (a key of --json)
    samples_exact: bool = True
    #: rows_per_stream / rows (None where the rows are decided during the run: adaptive)
    passes_per_stream: Optional[dict[str, float]] = None


@dataclass
class RankPlan:
    """One rank's share of an epoch (epoch 0): its slice of every global batch."""

    rank: int                  # global rank
    node: int
    local_rank: int
    batches_per_epoch: int
    samples_per_epoch: int
    #: counted over the epoch's leaf patterns; None where the plan was asked not to count
    rows_per_stream: Optional[dict[str, int]]


@dataclass
class GroupPlan:
    """A group of ``train_loader.streams`` (a pattern entry) and the streams it weights."""

    pattern: str
    members: list[str]
    weight: str                # repeat, proportion or choose
    value: float               # as given in the YAML (the group's, not a member's)


@dataclass(frozen=True)
class Plan:
    """The mixture per epoch and, given ``max_duration``, how long the run is: every field set
    at construction (a stage's duration and an adaptive restatement make a new one)."""

    streams: list[StreamPlan]
    epoch_size: int
    batch_size: int
    world_size: int
    global_batch_size: int
    batches_per_epoch: int
    samples_per_epoch: int     # samples in the full batches of an epoch (what is trained)
    max_seq_len: int
    batching_method: str
    shuffle_seed: int
    duration: Optional[DurationPlan] = None
    duration_name: str = 'max_duration'   # 'stage duration' in a stage of a staged run
    nodes: int = 1
    ranks_per_node: int = 1
    #: always 1: one global order on any topology (a key of --json)
    num_canonical_nodes: int = 1
    exact: bool = True
    #: rows per stream per epoch the weights ask for, and how many an exact epoch leaves out
    nominal_rows_per_epoch: dict[str, int] = field(default_factory=dict)
    left_out_per_epoch: dict[str, int] = field(default_factory=dict)
    #: rows trained a second time in an epoch to even out ranks: always 0 (a key of --json)
    repeated_rows_per_epoch: int = 0
    #: per rank (global rank order)
    per_rank: Optional[list[RankPlan]] = None
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: the epoch's weights (``epoch_size``, trimmed ``choose`` per stream, the exact unit)
    weights: Optional[EpochWeights] = None
    #: the YAML's stream groups (pattern entries), each with its members and given weight
    groups: list[GroupPlan] = field(default_factory=list)
    #: how each count ('epoch', 'per_rank', 'run') was made: 'arithmetic', 'counted' (exact,
    #: over the leaf patterns), or why it was not
    counted: dict[str, str] = field(default_factory=dict)
    #: an adaptive stage (``train_loader.adaptive``): segments, not epochs
    adaptive: bool = False

    def stream(self, name: str) -> StreamPlan:
        return next(s for s in self.streams if s.name == name)

    def to_dict(self) -> dict[str, Any]:
        """``dataclasses.asdict(self)``, equal and as unshared, built several times faster."""
        return _plain(self)


def _plain(obj: Any) -> Any:
    """:func:`dataclasses.asdict`'s result for a plan: its dataclasses, lists, tuples and dicts
    rebuilt, immutable scalars kept, any other leaf deep-copied."""
    kind = type(obj)
    if kind in _SCALARS:
        return obj
    names = _FIELDS.get(kind)
    if names is None and dataclasses.is_dataclass(kind):
        names = _FIELDS[kind] = tuple(f.name for f in dataclasses.fields(kind))
    scalars = _SCALARS  # a scalar is kept without a call: most of a plan's 10^5-10^6 leaves
    if names is not None:
        out = {}
        for name in names:
            value = getattr(obj, name)
            out[name] = value if type(value) in scalars else _plain(value)
        return out
    if kind is list:
        return [x if type(x) in scalars else _plain(x) for x in obj]
    if kind is tuple:
        return tuple(x if type(x) in scalars else _plain(x) for x in obj)
    if kind is dict:
        return {_plain(k): v if type(v) in scalars else _plain(v) for k, v in obj.items()}
    return copy.deepcopy(obj)  # what asdict makes of any other leaf (a numpy scalar, an array)


_SCALARS = frozenset((int, float, str, bool, type(None)))
_FIELDS: dict[type, tuple[str, ...]] = {}
