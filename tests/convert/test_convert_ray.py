"""``convert --engine ray``: a local Ray (2 CPUs) against the default engine, exactly.

The reference for a Ray run is the default engine run on each task's share of the input
written out as its own file (the Ray engine cuts tails and packs per task, by design):
the Ray rows must be those, concatenated in task order, byte for byte, and the manifest
counts their sums. Task 0's rows must also be the first rows of the default engine's
run on the whole input (the output only differs after a task boundary).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip('ray')

from convert_helpers import read_rows  # noqa: E402

from foundrymix import StreamMixer  # noqa: E402
from foundrymix.convert.finetune import FinetuneOptions, convert_finetune  # noqa: E402
from foundrymix.convert.pretrain import PretrainOptions, convert_pretrain  # noqa: E402
from foundrymix.convert.ray_engine import FAIL_ENV, plan_tasks  # noqa: E402
from foundrymix.convert.readers import InputError, plan_chunks, read_chunk_bytes  # noqa: E402
from foundrymix.format.schema import Manifest  # noqa: E402

SEQ = 256
#: small chunks and tasks so that the ~1 MB samples spread over several tasks
CHUNK, TASK = 64 << 10, 256 << 10


@pytest.fixture(scope='module', autouse=True)
def local_ray():
    """One local Ray for the module: 2 CPUs, no dashboard; shut down afterwards."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def split_by_task(inputs: list[Path], where: Path, chunk: int = CHUNK, task: int = TASK) -> list[Path]:
    """Each Ray task's input bytes as a file of its own (jsonl inputs)."""
    where.mkdir()
    pieces = []
    for i, chunks in enumerate(plan_tasks(plan_chunks([str(p) for p in inputs], chunk), task)):
        piece = where / f'piece{i}.jsonl'
        piece.write_bytes(b''.join(read_chunk_bytes(c) for c in chunks))
        pieces.append(piece)
    return pieces


def rows_equal(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        for key in ('input_ids', 'loss_spans', 'doc_lens'):
            np.testing.assert_array_equal(a[key], b[key])


def per_piece(convert, pieces: list[Path], tmp: Path, options) -> tuple[list[dict], list[Manifest]]:
    rows, manifests = [], []
    for i, piece in enumerate(pieces):
        manifests.append(convert([str(piece)], str(tmp / f'ref{i}'), options))
        rows += read_rows(tmp / f'ref{i}')
    return rows, manifests


def summed(manifests: list[Manifest]) -> dict:
    total = {k: sum(getattr(m.counts, k) for m in manifests) for k in manifests[0].counts.__dataclass_fields__}
    return total


def test_pretrain_equals_default_engine_per_task(tmp_path, arxiv_jsonl):
    local = PretrainOptions(max_seq_len=SEQ, workers=2, chunk_bytes=CHUNK)
    pieces = split_by_task([arxiv_jsonl], tmp_path / 'pieces')
    assert len(pieces) == 4
    want, refs = per_piece(convert_pretrain, pieces, tmp_path, local)
    opts = dataclasses.replace(local, engine='ray', ray_task_bytes=TASK)
    got = convert_pretrain([str(arxiv_jsonl)], str(tmp_path / 'ray'), opts)
    rows = read_rows(tmp_path / 'ray')
    rows_equal(rows, want)
    assert dataclasses.asdict(got.counts) == summed(refs)
    whole = convert_pretrain([str(arxiv_jsonl)], str(tmp_path / 'whole'), local)
    assert got.counts.rows * SEQ + got.counts.tail_tokens == whole.counts.rows * SEQ + whole.counts.tail_tokens
    assert got.counts.documents_read == whole.counts.documents_read == 20
    # lost to task boundaries: under one row per task boundary, all counted as tail
    assert 0 <= whole.counts.rows - got.counts.rows <= len(pieces) - 1
    rows_equal(rows[:refs[0].counts.rows], read_rows(tmp_path / 'whole')[:refs[0].counts.rows])
    assert Manifest.read(str(tmp_path / 'ray')).options == whole.options
    assert_reads_as_a_stream(tmp_path / 'ray', rows, got)


def assert_reads_as_a_stream(directory: Path, rows: list[dict], manifest: Manifest) -> None:
    """``plan`` and the training loader see the merged output like any stream: every row once."""
    mixer = StreamMixer.from_dict({'streams': {'ray': {'local': str(directory)}}, 'shuffle': False,
                                   'num_workers': 0})
    (plan,) = mixer.plan(1, '1ep').streams  # batches of 1 row: an epoch holds every row
    assert (plan.rows, plan.rows_per_epoch, plan.tokens_per_epoch) == (len(rows), len(rows), manifest.counts.tokens)
    ids = np.concatenate([b['input_ids'].numpy() for b in mixer.build_dataloader(1, world_size=1)])
    np.testing.assert_array_equal(ids, np.stack([r['input_ids'] for r in rows]).astype(np.int64))


def test_finetune_packs_per_task(tmp_path, dolly_jsonl):
    local = FinetuneOptions(max_seq_len=SEQ, workers=2, chunk_bytes=CHUNK, parallel='threads')
    pieces = split_by_task([dolly_jsonl], tmp_path / 'pieces')
    assert len(pieces) == 4
    want, refs = per_piece(convert_finetune, pieces, tmp_path, local)
    opts = dataclasses.replace(local, engine='ray', ray_task_bytes=TASK)
    got = convert_finetune([str(dolly_jsonl)], str(tmp_path / 'ray'), opts)
    rows_equal(read_rows(tmp_path / 'ray'), want)
    assert dataclasses.asdict(got.counts) == summed(refs)
    assert got.dropped == {'too_long': sum(m.dropped.get('too_long', 0) for m in refs)} and got.dropped['too_long'] > 0


def test_compressed_input_spreads_over_tasks(tmp_path, arxiv_jsonl):
    """A .jsonl.gz is read by the driver in blocks (they travel to the tasks as payloads)."""
    import gzip
    corpus = tmp_path / 'arxiv.jsonl.gz'
    corpus.write_bytes(gzip.compress(arxiv_jsonl.read_bytes()))
    local = PretrainOptions(max_seq_len=SEQ, workers=2, chunk_bytes=CHUNK)
    pieces = split_by_task([corpus], tmp_path / 'pieces')
    assert len(pieces) == 4
    want, refs = per_piece(convert_pretrain, pieces, tmp_path, local)
    got = convert_pretrain([str(corpus)], str(tmp_path / 'ray'),
                           dataclasses.replace(local, engine='ray', ray_task_bytes=TASK))
    rows_equal(read_rows(tmp_path / 'ray'), want)
    assert dataclasses.asdict(got.counts) == summed(refs)


def bad_corpus(path: Path, arxiv_jsonl: Path) -> Path:
    """The arXiv sample with bad records between documents: spread over every task."""
    lines = arxiv_jsonl.read_bytes().splitlines(keepends=True)
    bad = [b'{not json\n', b'{"text": 3}\n', b'{"other": "x"}\n', b'{"text": ""}\n']
    out = []
    for i, line in enumerate(lines):
        out += [line, bad[i % len(bad)]]
    path.write_bytes(b''.join(out))
    return path


def test_skip_counts_and_raise_match_default_engine(tmp_path, arxiv_jsonl):
    corpus = bad_corpus(tmp_path / 'bad.jsonl', arxiv_jsonl)
    local = PretrainOptions(max_seq_len=SEQ, workers=2, chunk_bytes=CHUNK, on_error='skip')
    whole = convert_pretrain([str(corpus)], str(tmp_path / 'whole'), local)
    opts = dataclasses.replace(local, engine='ray', ray_task_bytes=TASK)
    got = convert_pretrain([str(corpus)], str(tmp_path / 'ray'), opts)
    assert got.skipped == whole.skipped == {'malformed_json': 5, 'not_string': 5, 'missing_field': 5,
                                            'empty_document': 5}
    assert got.skipped_at == whole.skipped_at
    assert got.skipped_at['malformed_json'][1] == f'{corpus}:10'
    with pytest.raises(InputError) as ray_err:
        convert_pretrain([str(corpus)], str(tmp_path / 'ray-raise'),
                         dataclasses.replace(opts, on_error='raise'))
    assert str(ray_err.value) == f"{corpus}:2: malformed JSON: Expecting property name enclosed in double quotes (column 2)"
    assert not (tmp_path / 'ray-raise').exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith('.')] == []


def test_task_killed_midway_is_retried_with_identical_output(tmp_path, arxiv_jsonl, monkeypatch):
    opts = PretrainOptions(max_seq_len=SEQ, workers=2, chunk_bytes=CHUNK, engine='ray', ray_task_bytes=TASK)
    clean = convert_pretrain([str(arxiv_jsonl)], str(tmp_path / 'clean'), opts)
    marker = tmp_path / 'task1-died'
    monkeypatch.setenv(FAIL_ENV, f'1:{marker}')
    retried = convert_pretrain([str(arxiv_jsonl)], str(tmp_path / 'retried'), opts)
    assert marker.exists()  # the first attempt of task 1 did die
    assert retried.counts == clean.counts
    rows_equal(read_rows(tmp_path / 'retried'), read_rows(tmp_path / 'clean'))
    assert (tmp_path / 'retried' / 'index.json').read_text() == (tmp_path / 'clean' / 'index.json').read_text()


def test_task_failing_for_good_fails_the_job_and_leaves_nothing(tmp_path, arxiv_jsonl, monkeypatch):
    """Every attempt of task 2 raises (its marker cannot be created): after Ray's retries the
    conversion fails with that error, and neither ``--out`` nor a partial directory is left."""
    opts = PretrainOptions(max_seq_len=SEQ, workers=2, chunk_bytes=CHUNK, engine='ray', ray_task_bytes=TASK)
    monkeypatch.setenv(FAIL_ENV, f"2:{tmp_path / 'no-such-dir' / 'marker'}")
    with pytest.raises(ray.exceptions.RayTaskError, match='FileNotFoundError'):
        convert_pretrain([str(arxiv_jsonl)], str(tmp_path / 'out' / 'failed'), opts)
    assert list((tmp_path / 'out').iterdir()) == []


def test_cli_engine_ray(tmp_path, arxiv_jsonl, capsys):
    from foundrymix.cli import main
    assert main(['convert', 'pretrain', str(arxiv_jsonl), '--out', str(tmp_path / 'cli'), '--max-seq-len',
                 str(SEQ), '--engine', 'ray', '--no-progress']) == 0
    m = Manifest.read(str(tmp_path / 'cli'))
    assert m.counts.documents_read == 20 and m.counts.rows == len(read_rows(tmp_path / 'cli'))
    assert 'engine' not in m.options


@pytest.mark.slow
def test_two_node_cluster(tmp_path, arxiv_jsonl):
    """Real raylets: a head and a worker node (1 CPU each) give the very same output as the local Ray."""
    from ray.cluster_utils import Cluster
    opts = PretrainOptions(max_seq_len=SEQ, chunk_bytes=CHUNK, engine='ray', ray_task_bytes=TASK)
    one = convert_pretrain([str(arxiv_jsonl)], str(tmp_path / 'one'), opts)
    ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={'num_cpus': 1, 'include_dashboard': False})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        two = convert_pretrain([str(arxiv_jsonl)], str(tmp_path / 'two'), opts)
        nodes = {n['NodeID'] for n in ray.nodes() if n['Alive']}
    finally:
        ray.shutdown()
        cluster.shutdown()
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)  # for the tests after this one
    assert len(nodes) == 2
    assert two.counts == one.counts
    rows_equal(read_rows(tmp_path / 'two'), read_rows(tmp_path / 'one'))


def test_overwrite_replaces_a_ray_output_and_no_rows_publishes_nothing(tmp_path, arxiv_jsonl):
    """A Ray output (shards in ``task-NNNNN/``) is a foundrymix dataset that --overwrite may
    replace, but not once a foreign file sits among its shards; a Ray conversion with no
    rows publishes nothing (the old output stays byte for byte)."""
    import hashlib
    import os

    from foundrymix.convert.report import EmptyOutputError
    from foundrymix.convert.output import OutputExistsError

    def tree(root: Path) -> dict[str, str]:
        return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(root.rglob('*')) if p.is_file()}

    opts = PretrainOptions(max_seq_len=SEQ, workers=2, chunk_bytes=CHUNK, engine='ray', ray_task_bytes=TASK)
    out = tmp_path / 'out'
    convert_pretrain([str(arxiv_jsonl)], str(out), opts)
    assert sorted(os.listdir(out)) == ['foundrymix.json', 'index.json', *[f'task-0000{i}' for i in range(4)]]
    (out / 'task-00001' / 'notes.txt').write_text('mine')
    with pytest.raises(OutputExistsError, match=r'holds files foundrymix did not write \(task-00001/notes.txt\)'):
        convert_pretrain([str(arxiv_jsonl)], str(out), dataclasses.replace(opts, overwrite=True))
    os.remove(out / 'task-00001' / 'notes.txt')
    before = tree(out)
    with pytest.raises(EmptyOutputError, match=r'no rows to write, so nothing was published: 20 documents read'):
        convert_pretrain([str(arxiv_jsonl)], str(out), dataclasses.replace(opts, overwrite=True,
                                                                           max_seq_len=1_000_000_000))
    assert tree(out) == before and sorted(os.listdir(tmp_path)) == ['out']
    # replaced by a default-engine output: the task folders go with their shards
    m = convert_pretrain([str(arxiv_jsonl)], str(out), dataclasses.replace(opts, engine='local', overwrite=True))
    assert sorted(os.listdir(out)) == ['foundrymix.json', 'index.json', 'shard.00000.mds']
    assert len(read_rows(out)) == m.counts.rows and sorted(os.listdir(tmp_path)) == ['out']
