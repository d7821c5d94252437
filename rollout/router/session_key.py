"""Which session an HTTP call belongs to, as the routers and agent frameworks of the field name it
(issue 66 item 2). The first that is there wins:

1. the `X-Session-ID` header (vllm-router's sticky_least_loaded, NeMo Gym's session_affinity_header);
2. the body's `session_id` (vllm-router reads it there too);
3. SGLang's `session_params.id` (its /generate and OpenAI routes);
4. OpenAI's `user` (an end user's id: one agent episode per user in most environments).

None: a call of no session (placed on the least busy sidecar). Pure: no sockets.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

HEADER = "x-session-id"
MAX_LEN = 256  # a longer key is refused: it is not an id, and pins are kept in memory


def session_key(headers: Mapping[str, str], body: Any) -> str | None:
    """The call's session key, or None. Raises ValueError for a key that is not a short string."""
    key = headers.get(HEADER)
    if key is None and isinstance(body, dict):
        params = body.get("session_params")
        for found in (body.get("session_id"), params.get("id") if isinstance(params, dict) else None,
                      body.get("user")):
            if found is not None:
                key = found
                break
    if key is None:
        return None
    if not isinstance(key, str) or not key or len(key) > MAX_LEN:
        raise ValueError(f"a session id must be a non-empty string of at most {MAX_LEN} characters, got {key!r}")
    return key
