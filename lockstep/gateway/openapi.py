"""The OpenAPI document: FastAPI's own, plus the bodies of routes that read their body by hand.

`forward_backward` takes protobuf (what the SDK sends) or JSON, so it cannot declare a pydantic
body parameter; its route points at `#/components/schemas/<Model>` through `openapi_extra`, and
this module puts those models (and the models they nest) into the document's components.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

_REF = "#/components/schemas/{model}"


def body_ref(model: type[BaseModel], *, protobuf: str | None = None) -> dict[str, object]:
    """`openapi_extra` for a route whose JSON body is `model` (and, optionally, protobuf)."""
    content: dict[str, object] = {
        "application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}
    }
    if protobuf is not None:
        content["application/x-protobuf"] = {
            "schema": {"type": "string", "format": "binary", "description": protobuf}
        }
    return {"requestBody": {"required": True, "content": content}}


def install_openapi(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Make `app.openapi()` include `models` (the ones `body_ref` points at) as components."""
    default = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = default()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in models:
            doc = model.model_json_schema(ref_template=_REF)
            for name, sub in doc.pop("$defs", {}).items():
                components.setdefault(name, sub)
            components[model.__name__] = doc
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
