"""GET /openapi.json: every route of the app is in it, every documented example body is accepted by the real
server (its parser and its route), and the documented bodies are the schemas the routes parse with."""

from __future__ import annotations

import json

import httpx
import pytest

from mlxcel_core.server.openapi import REQUEST_BODIES


@pytest.fixture(scope="module")
def document(server) -> dict:
    response = httpx.get(f"{server.url}/openapi.json", timeout=30)
    assert response.status_code == 200
    return response.json()


def test_every_route_is_documented(server, document):
    routes = {(r.path, m.lower()) for r in server.app.routes for m in r.methods if m != "HEAD"}
    documented = {(path, method) for path, ops in document["paths"].items() for method in ops}
    assert documented == routes
    assert {"/v1/chat/completions", "/v1/completions", "/openapi.json"} <= {path for path, _ in routes}


def test_request_bodies_are_the_parsers_schemas(document):
    schemas = document["components"]["schemas"]
    for path, (model, _) in REQUEST_BODIES.items():
        body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"] == {"$ref": f"#/components/schemas/{model.__name__}"}
        # the document's properties are the parser's fields (by their JSON names), its required ones required
        fields = {f.alias or name for name, f in model.model_fields.items()}
        assert set(schemas[model.__name__]["properties"]) == fields
        assert set(schemas[model.__name__].get("required", [])) == {
            f.alias or name for name, f in model.model_fields.items() if f.is_required()
        }
    assert "ErrorResponse" in schemas


@pytest.mark.parametrize("path", sorted(REQUEST_BODIES))
def test_documented_examples_are_accepted(server, document, path):
    example = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["example"]
    model, _ = REQUEST_BODIES[path]
    model.model_validate_json(json.dumps(example))  # the route's parser
    response = httpx.post(f"{server.url}{path}", json=example, timeout=60)
    assert response.status_code == 200, response.text


def test_the_document_needs_the_key_when_the_routes_do(make_server):
    running = make_server(api_key="sekret", warmup=False)
    assert httpx.get(f"{running.url}/openapi.json", timeout=30).status_code == 401
    response = httpx.get(f"{running.url}/openapi.json", headers=running.auth_headers(), timeout=30)
    assert response.status_code == 200
    document = response.json()
    assert document["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    assert document["paths"]["/v1/models"]["get"]["security"] == [{"bearer": []}]
    assert "security" not in document["paths"]["/health"]["get"]
