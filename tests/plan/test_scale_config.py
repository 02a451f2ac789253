"""Configs at scale: a plain YAML of 10,000 streams is read; an alias bomb is still refused.

omegaconf 2.4 refuses a document that expands to more than 10,000 nodes; foundrymix raises
that limit to the file's own size plus omegaconf's 10,000 (``foundrymix.config.loading._node_limit``).
"""

from __future__ import annotations

import pytest
import yaml

from foundrymix.config import ConfigError, load_yaml

N = 10_000


def test_a_plain_yaml_of_ten_thousand_streams_is_read(tmp_path):
    streams = {f'web/s{i:05d}': {'local': f'/data/web/s{i:05d}', 'repeat': 1} for i in range(N)}
    path = tmp_path / 'big.yaml'
    path.write_text(yaml.safe_dump({'max_seq_len': 256, 'train_loader': {'streams': streams}}))
    data = load_yaml(str(path), [f'train_loader.streams.web/s{N - 1:05d}.repeat=2'])
    got = data['train_loader']['streams']
    assert len(got) == N and list(got) == list(streams)
    assert got['web/s00000'] == {'local': '/data/web/s00000', 'repeat': 1}
    assert got[f'web/s{N - 1:05d}']['repeat'] == 2


def test_an_alias_bomb_is_still_refused(tmp_path):
    # 9 levels of 10 aliases each: a 400-byte file that expands to 10^9 nodes
    lines = ['a0: &a0 [x, x, x, x, x, x, x, x, x, x]']
    for i in range(1, 9):
        lines.append(f'a{i}: &a{i} [' + ', '.join([f'*a{i - 1}'] * 10) + ']')
    path = tmp_path / 'bomb.yaml'
    path.write_text('\n'.join(lines) + '\n')
    with pytest.raises(ConfigError, match='bomb.yaml: not valid YAML: .*(limit|aliases expand)'):
        load_yaml(str(path))


@pytest.mark.parametrize('text', [
    'a: 1\nb: [1.5, 1e-3, .inf, null, true, "x"]\nc: {d: {e: f}}\n',           # plain: read without omegaconf
    'a: &x {b: 1}\nc: *x\n',                                                 # a shared node
    'a: 3\nb: ${a}\nc: "\\\\${a}"\nd: "$HOME"\n',                               # interpolation, escape, a $
    '1: a\nb: 2020-01-01\n',                                                 # a non-string key, a date
])
def test_a_plain_yaml_reads_as_omegaconf_reads_it(tmp_path, text):
    """The plain-YAML fast path (a 1,000-stream YAML took 3.9 s in omegaconf, issue 22)
    gives what omegaconf gives, and whatever it cannot prove plain goes through omegaconf."""
    from omegaconf import OmegaConf
    path = tmp_path / 'c.yaml'
    path.write_text(text)
    try:
        want = OmegaConf.to_container(OmegaConf.load(str(path)), resolve=True)
    except Exception:  # noqa: BLE001 -- then ours refuses too
        with pytest.raises(ConfigError):
            load_yaml(str(path))
        return
    got = load_yaml(str(path))
    assert got == want and [type(v) for v in got.values()] == [type(v) for v in want.values()]
