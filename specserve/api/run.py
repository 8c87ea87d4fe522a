"""Serve the HTTP API with uvicorn until SIGINT/SIGTERM."""

from __future__ import annotations

import uvicorn

from specserve.api.app import ApiSettings, create_app


def run_api(settings: ApiSettings, log_level: str = "warning") -> int:
    config = uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    print(
        f"specserve api: http://{settings.host}:{settings.port}/v1 -> {','.join(settings.control)}",
        flush=True,
    )
    server.run()
    return 0
