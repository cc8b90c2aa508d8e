"""What every config section shares: the error type, the model base, URL redaction."""

from __future__ import annotations

import urllib.parse
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

MIB = 1024 * 1024


class ConfigError(ValueError):
    """A configuration that cannot be used; ``errors`` holds one line per problem."""

    def __init__(self, errors: list[str], source: str | None = None) -> None:
        self.errors = errors
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(where + "; ".join(errors))


class ConfigModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # inf: a TTL never ending, a timeout never firing



PositiveFloat = Annotated[float, Field(gt=0)]


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (userinfo and ``?password=``); else unchanged."""
    try:
        parts = urllib.parse.urlsplit(url)
        netloc = parts.netloc
        if parts.password is not None:
            user, _, host = netloc.rpartition("@")
            netloc = f"{user.partition(':')[0]}:***@{host}"
        query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
        if any(k.lower() == "password" for k, _ in query):
            masked = [(k, "***" if k.lower() == "password" else v) for k, v in query]
            parts = parts._replace(query=urllib.parse.urlencode(masked, safe="*"))
        out = urllib.parse.urlunsplit(parts._replace(netloc=netloc))
        if url.startswith(f"{parts.scheme}://") and not out.startswith(f"{parts.scheme}://"):
            out = f"{parts.scheme}://{out.partition(':')[2]}"  # unix:///tmp/r.sock: urlunsplit dropped the //
        return out
    except ValueError:  # unparsable: show no part of it that could hold a secret
        return "<unparsable redis url>"
