"""specserve: LLM serving with speculative decoding."""

from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:
    from specserve.client import AsyncClient, Client, fetch_status, get_status
    from specserve.llm import LLM
    from specserve.shared.protocol import SamplingParams

__all__ = [
    "LLM",
    "AsyncClient",
    "Client",
    "SamplingParams",
    "__version__",
    "fetch_status",
    "get_status",
]


def __getattr__(name: str):
    # Lazy, so that importing the control plane never imports torch.
    if name == "LLM":
        from specserve.llm import LLM

        return LLM
    if name in ("Client", "AsyncClient", "get_status", "fetch_status"):
        from specserve import client

        return getattr(client, name)
    if name == "SamplingParams":
        from specserve.shared.protocol import SamplingParams

        return SamplingParams
    raise AttributeError(name)
