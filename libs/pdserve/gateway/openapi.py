"""The request bodies in the gateway's OpenAPI document (`/openapi.json`).

The generation endpoints read their body themselves (`serving.parse`: any content type, OpenAI's error
shape), so FastAPI cannot infer it; `document_bodies(model)` states it from the same pydantic model, with
every `$ref` inlined (the models are not recursive), so clients and fuzzers (schemathesis) see the real
schema.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            target = _inline(defs[ref.removeprefix("#/$defs/")], defs)
            rest = {k: _inline(v, defs) for k, v in node.items() if k != "$ref"}
            return {**target, **rest}
        return {k: _inline(v, defs) for k, v in node.items() if k != "$defs"}
    if isinstance(node, list):
        return [_inline(v, defs) for v in node]
    return node


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """`model`'s JSON schema (validation mode) with its `$defs` inlined."""
    schema = model.model_json_schema()
    return _inline(schema, schema.get("$defs", {}))


def document_bodies(model: type[BaseModel]) -> dict[str, Any]:
    """The `openapi_extra` of a route whose JSON body is `model`."""
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": body_schema(model)}}}}
