"""Where the Redis URL comes from, so that a Redis password never sits on a command line.

Every user of a machine can read every process's arguments (`ps`, /proc/PID/cmdline), but not
its environment or a file with mode 0600. A URL with credentials (`redis://:PASSWORD@HOST:PORT/DB`,
`rediss://` for TLS) therefore comes from `--redis-url-file PATH` or the SPECSERVE_REDIS_URL
environment variable; `--redis-url` takes only a URL without a password.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

REDIS_URL_ENV = "SPECSERVE_REDIS_URL"
SCHEMES = ("redis", "rediss", "unix")

PASSWORD_ON_COMMAND_LINE = (
    "--redis-url must not hold a password: every user of this machine can read a process's "
    f"arguments. Put the URL in a file only you can read and pass --redis-url-file PATH, or set "
    f"{REDIS_URL_ENV}"
)


class RedisUrlError(ValueError):
    """A Redis URL that cannot be used; the message never shows its password."""


def has_password(url: str) -> bool:
    parts = urlsplit(url)
    return parts.password is not None or "password" in parse_qs(parts.query)


def redact(url: str) -> str:
    """`url` with its password (in the user part or the query) replaced by `***`."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        user, _, host = netloc.rpartition("@")
        netloc = f"{user.partition(':')[0]}:***@{host}"
    query = "&".join(
        "password=***" if pair.partition("=")[0] == "password" else pair
        for pair in parts.query.split("&")
    )
    return parts._replace(netloc=netloc, query=query).geturl()


def check_redis_url_argument(url: str) -> str:
    """A `--redis-url` value: RedisUrlError if it holds a password or is not a Redis URL."""
    if has_password(url):
        raise RedisUrlError(PASSWORD_ON_COMMAND_LINE)
    return _check_scheme(url, "--redis-url")


def resolve_redis_url(
    flag: str | None, file: str | None, environ: Mapping[str, str] | None = None
) -> str | None:
    """The Redis URL from `--redis-url`, else `--redis-url-file`, else SPECSERVE_REDIS_URL;
    None when none of them is given."""
    if flag is not None and file is not None:
        raise RedisUrlError("give --redis-url or --redis-url-file, not both")
    if flag is not None:
        return check_redis_url_argument(flag)
    if file is not None:
        try:
            url = Path(file).read_text().strip()
        except OSError as exc:
            raise RedisUrlError(f"--redis-url-file {file}: {exc.strerror or exc}") from None
        if not url:
            raise RedisUrlError(f"--redis-url-file {file} is empty")
        return _check_scheme(url, f"the URL in {file}")
    url = (os.environ if environ is None else environ).get(REDIS_URL_ENV, "").strip()
    return _check_scheme(url, REDIS_URL_ENV) if url else None


def _check_scheme(url: str, where: str) -> str:
    scheme = urlsplit(url).scheme
    if scheme not in SCHEMES:
        raise RedisUrlError(
            f"{where} must be a redis://, rediss:// (TLS) or unix:// URL, got {redact(url)!r}"
        )
    return url
