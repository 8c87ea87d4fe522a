"""Redis clients for the index, with timeouts and retries fit for a request path.

redis-py's defaults (5 s socket timeouts, ten retries with backoff) could stall a scheduling step
for seconds while Redis is down. The index is an optimisation, so it should fail fast and let the
caller continue; the background janitor and resync retry later.
"""

from __future__ import annotations

from redis import Redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry


def connect(
    url: str,
    *,
    socket_timeout: float = 0.5,
    connect_timeout: float = 0.25,
    retries: int = 1,
) -> Redis:
    """A client for `url` (redis://host:port/db) that gives up within about a second."""
    return Redis.from_url(
        url,
        socket_timeout=socket_timeout,
        socket_connect_timeout=connect_timeout,
        retry=Retry(ExponentialBackoff(cap=0.05, base=0.005), retries),
        decode_responses=False,
    )


def check_client(client: Redis) -> Redis:
    """Keys and reverse-set members are raw bytes: responses must not be decoded to str."""
    if client.connection_pool.connection_kwargs.get("decode_responses"):
        raise ValueError("the cache index needs a Redis client with decode_responses=False")
    return client
