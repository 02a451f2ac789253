"""foundrymix: convert corpora to one MDS sample schema, mix streams exactly, train with Composer."""

__version__ = '0.1.0'

from typing import Any

__all__ = ['__version__', 'StreamMixer', 'build_loader']


def __getattr__(name: str) -> Any:
    # Lazy: importing foundrymix (e.g. in conversion workers) must not import torch/streaming.
    if name == 'StreamMixer':
        from foundrymix.loader.mixer import StreamMixer
        return StreamMixer
    if name == 'build_loader':
        from foundrymix.api import build_loader
        return build_loader
    raise AttributeError(name)
