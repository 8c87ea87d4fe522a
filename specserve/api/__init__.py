"""specserve's OpenAI-compatible HTTP API (`specserve api`): FastAPI over the asyncio SDK."""

from specserve.api.app import ApiSettings, create_app
from specserve.api.run import run_api

__all__ = ["ApiSettings", "create_app", "run_api"]
