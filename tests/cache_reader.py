"""A real loader process for the cache tests: ``python cache_reader.py SPEC.json``.

SPEC: ``loader`` (a train_loader mapping), ``batch``, ``out`` (JSON lines written here),
``iterations`` (epochs, each over a freshly built dataset), and optionally ``sync`` (a
directory and this process's name and its peer's: after building each dataset and after
reading each epoch, both wait for the other, so their datasets are alive at the same
time), ``pause_after`` (batches; then write ``<out>.paused`` and sleep, to be killed) and
``go`` (a file to wait for between building and reading).
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import sys
import time


def summary(loader) -> dict:
    """An epoch as sample ids per batch and a hash of every batch's tensors."""
    ids, digest = [], hashlib.sha256()
    for batch in loader:
        ids.append(batch['sample_id'].tolist())
        for key in sorted(batch):
            digest.update(key.encode())
            digest.update(batch[key].numpy().tobytes())
    return {'sample_ids': ids, 'sha256': digest.hexdigest()}


def _wait(path: str, limit: float = 80) -> None:
    deadline = time.monotonic() + limit
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(path)
        time.sleep(0.02)


def main(spec_path: str) -> None:
    import faulthandler
    faulthandler.dump_traceback_later(90, exit=True)  # a hang shows where, and ends
    from foundrymix.loader.mixer import StreamMixer
    spec = json.loads(open(spec_path, encoding='utf-8').read())
    sync = spec.get('sync')
    with open(spec['out'], 'w', encoding='utf-8') as out:
        for it in range(spec.get('iterations', 1)):
            mixer = StreamMixer.from_dict(spec['loader'])
            loader = mixer.build_dataloader(batch_size=spec['batch'])
            dataset = loader.storage
            locals_ = [s.directory for s in dataset.sources]
            if sync:
                open(os.path.join(sync['dir'], f"built-{sync['me']}-{it}"), 'w').close()
                _wait(os.path.join(sync['dir'], f"built-{sync['peer']}-{it}"))
            if spec.get('go'):
                open(spec['out'] + '.built', 'w').close()
                _wait(spec['go'])
            if spec.get('pause_after'):
                for n, _ in enumerate(loader, 1):
                    if n == spec['pause_after']:
                        open(spec['out'] + '.paused', 'w').close()
                        time.sleep(600)
            record = dict(summary(loader), locals=locals_)
            out.write(json.dumps(record) + '\n')
            out.flush()
            if sync:
                open(os.path.join(sync['dir'], f"read-{sync['me']}-{it}"), 'w').close()
                _wait(os.path.join(sync['dir'], f"read-{sync['peer']}-{it}"))
            del loader
            gc.collect()
            dataset.release()
            del dataset


if __name__ == '__main__':
    main(sys.argv[1])
