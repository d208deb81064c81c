"""/openapi.json for routes that parse their own body (free-form JSON, dispatch on shape): each names
the pydantic models it validates with, and they are published under components.schemas."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

_MODELS: dict[str, type[BaseModel]] = {}


def documented(*models: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` of a route whose body is one of `models` (several: told apart by its keys)."""
    refs = []
    for m in models:
        _MODELS[m.__name__] = m
        refs.append({"$ref": f"#/components/schemas/{m.__name__}"})
    schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
    return {"requestBody": {"required": False, "content": {"application/json": {"schema": schema}}}}


def install_openapi(app: FastAPI, limits: dict[str, int]) -> None:
    """`limits`: the served configuration's caps (field name -> maximum), written into every schema."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _, defs = models_json_schema(
                [(m, "validation") for m in _MODELS.values()], ref_template="#/components/schemas/{model}"
            )
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for name, definition in defs.get("$defs", {}).items():
                components.setdefault(name, definition)
            for definition in components.values():
                _apply_limits(definition, limits)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _apply_limits(definition: dict[str, Any], limits: dict[str, int]) -> None:
    for name, prop in definition.get("properties", {}).items():
        if name in limits:
            for variant in prop.get("anyOf", [prop]):
                if variant.get("type") == "integer":
                    variant["maximum"] = limits[name]
                elif variant.get("type") == "array" and variant.get("items", {}).get("type") == "integer":
                    variant["items"]["maximum"] = limits[name]
