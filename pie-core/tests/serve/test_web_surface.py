"""The HTTP surface around the API, served in this process with no model (the model's routes answer 503
"loading"): HEAD on every GET route."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from pie.serve.app import ServerState, ServeSettings, create_app

GET_ROUTES = ("/", "/ui/app.js", "/ui/style.css", "/metrics", "/v1/pie/status", "/v1/pie/plan", "/health",
              "/openapi.json")


def client(**settings: object) -> TestClient:
    return TestClient(create_app(ServerState(ServeSettings(served_model_name="tiny", **settings))))


@pytest.mark.parametrize("path", GET_ROUTES)
def test_every_get_route_answers_head_with_its_headers_and_no_body(path: str) -> None:
    """Uptime checkers and `curl -I` probe with HEAD: the page, its files, /metrics, status and plan answered 405."""
    with client() as open_server:
        got, head = open_server.get(path), open_server.head(path)
    assert head.status_code == got.status_code != 405, (head.status_code, head.text)
    assert head.content == b""
    names = {name for name in got.headers if name not in ("content-length", "x-request-id")}
    assert names == {name for name in head.headers if name not in ("content-length", "x-request-id")}
    for name in names - {"date"}:
        assert head.headers[name] == got.headers[name], name  # the page's CSP among them


def test_head_routes_add_no_operation_to_the_api_schema() -> None:
    with client() as open_server:
        paths = open_server.get("/openapi.json").json()["paths"]
    assert set(paths["/v1/pie/status"]) == set(paths["/metrics"]) == set(paths["/health"]) == {"get"}
