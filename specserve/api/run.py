"""Serve the HTTP API with uvicorn until SIGINT/SIGTERM."""

from __future__ import annotations

import socket

import uvicorn

from specserve.api.app import ApiSettings, ApiState, create_app

GRACEFUL_SHUTDOWN_S = 5  # for responses other than generations, which end at once


class ApiServer(uvicorn.Server):
    """uvicorn's server, whose shutdown first ends the generations in flight: each stream gets
    an error event and its end, each request is aborted on the control plane, and the process
    exits without waiting out the graceful timeout or cancelling them mid-write."""

    def __init__(self, config: uvicorn.Config, state: ApiState) -> None:
        super().__init__(config)
        self.state = state

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await self.state.stop_generations()
        await super().shutdown(sockets=sockets)


def run_api(settings: ApiSettings, log_level: str = "warning") -> int:
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    server = ApiServer(config, app.state.api)
    print(
        f"specserve api: http://{settings.host}:{settings.port}/v1 -> {','.join(settings.control)}",
        flush=True,
    )
    server.run()
    return 0
