"""Shard files against ``index.json``: read the index, stat the shards (placeholder, see merge)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ShardProblem:
    shard: str
    problem: str

    def __str__(self) -> str:
        return f'{self.shard}: {self.problem}'


def read_index(path: str) -> dict[str, Any]:
    with open(path, encoding='utf-8') as f:
        try:
            index = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f'{path}: not valid JSON: {e}') from e
    if not isinstance(index, dict) or not isinstance(index.get('shards'), list):
        raise ValueError(f'{path}: not an MDS index (no shards list)')
    return index


def hashes_in_index(index: dict[str, Any]) -> set[str]:
    sets = [set((s.get('raw_data') or {}).get('hashes') or {}) for s in index['shards']]
    return set.intersection(*sets) if sets else set()


def check_shard_files(directory: str, index: dict[str, Any], missing_ok: bool = False) -> list[ShardProblem]:
    problems = []
    for shard in index['shards']:
        for key in ('raw_data', 'zip_data'):
            data = shard.get(key)
            if not data:
                continue
            path = os.path.join(directory, data['basename'])
            if os.path.exists(path):
                size = os.path.getsize(path)
                if size != int(data['bytes']):
                    problems.append(ShardProblem(data['basename'], f'{size:,} bytes, index.json records {int(data["bytes"]):,}'))
                break
        else:
            if not missing_ok:
                problems.append(ShardProblem(shard['raw_data']['basename'], 'missing'))
    return problems
