"""``ModelInfo``: what ``foundrymix export`` needs to rebuild the model, in every checkpoint (as a
callback's ``state_dict``: Composer saves neither the transformers config nor the tokenizer), so an
export never guesses the architecture from a YAML that may have changed since.
"""

from __future__ import annotations

from typing import Any, Optional

from composer.core import Callback

from foundrymix.format.schema import TokenizerInfo


class ModelInfo(Callback):
    """Records the HF config, attention mode, the streams' tokenizer and a LoRA run's peft config
    (saved, never loaded)."""

    def __init__(self, hf_config: Any, attention: str, tokenizer: TokenizerInfo,
                 pretrained: Optional[str] = None, peft: Optional[dict[str, Any]] = None) -> None:
        self.hf_config = hf_config
        self.attention = attention
        self.tokenizer = tokenizer
        self.pretrained = pretrained
        self.peft = peft

    def state_dict(self) -> dict[str, Any]:
        """``peft``: a LoRA run's ``LoraConfig`` arguments (None: every weight trained)."""
        return {'hf_config': self.hf_config.to_dict(), 'attention': self.attention,
                'tokenizer': self.tokenizer.name, 'tokenizer_fingerprint': self.tokenizer.fingerprint,
                'pretrained': self.pretrained, 'peft': self.peft}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore: this run's model describes itself."""
