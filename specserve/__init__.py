"""specserve: LLM serving with speculative decoding."""

from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:
    from specserve.llm import LLM
    from specserve.shared.protocol import SamplingParams

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy, so that importing the control plane never imports torch.
    if name == "LLM":
        from specserve.llm import LLM

        return LLM
    if name == "SamplingParams":
        from specserve.shared.protocol import SamplingParams

        return SamplingParams
    raise AttributeError(name)
