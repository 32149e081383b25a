"""Fields that the protocols' published response types require and deepseek-recipe leaves out.

deepseek-recipe 0.2.0 writes response bodies that omit some fields the official SDKs' types require,
so a client that parses dsjax's output with them (`openai.types.responses.Response.model_validate`,
for one) fails. `complete_body` adds each such field with the value that is true of this engine, and
nothing else: it never overwrites what the recipe wrote, never makes up a missing object around a
field, and so is idempotent. The tests check every body kind against the openai and anthropic SDKs'
own types (pinned in the `test` extra), so a recipe or SDK change that opens a new gap shows there.
"""

from __future__ import annotations

from typing import Any

# endpoint -> [(path to an object in the body, the fields it must hold and their value for dsjax)]
_FILL: dict[str, list[tuple[tuple[str, ...], dict[str, Any]]]] = {
    "/v1/chat/completions": [],
    "/v1/responses": [
        # dsjax keeps no prompt cache: it writes no input token to one (it reads none either, the
        # recipe's `cached_tokens: 0`).
        (("usage", "input_tokens_details"), {"cache_write_tokens": 0}),
    ],
    "/v1/messages": [],
}


def complete_body(endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    """`body` (a response body of `endpoint`) with the fields its protocol requires and the recipe left
    out filled in; a new dict where anything was added (copied along the path only), `body` otherwise.
    Fields already there are kept as they are; an object on a path that is absent or null stays so."""
    try:
        fills = _FILL[endpoint]
    except KeyError:
        raise ValueError(f"no response body type is known for endpoint {endpoint!r}") from None
    for path, fields in fills:
        body = _fill(body, path, fields)
    return body


def _fill(obj: dict[str, Any], path: tuple[str, ...], fields: dict[str, Any]) -> dict[str, Any]:
    if not path:
        missing = {k: v for k, v in fields.items() if k not in obj}
        return {**obj, **missing} if missing else obj
    child = obj.get(path[0])
    if not isinstance(child, dict):
        return obj
    new = _fill(child, path[1:], fields)
    return obj if new is child else {**obj, path[0]: new}
