"""The HTTP surface around the API, served in this process with no model (the model's routes answer 503
"loading"): HEAD on every GET route, a refused CORS preflight, and which paths take the key and how."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient
from typer.main import get_command

from pie.cli import app
from pie.serve.app import ServerState, ServeSettings, create_app, key_rule

KEY = "s3cret"
GET_ROUTES = ("/", "/ui/app.js", "/ui/style.css", "/metrics", "/v1/pie/status", "/v1/pie/plan", "/health",
              "/openapi.json")


def client(**settings: object) -> TestClient:
    return TestClient(create_app(ServerState(ServeSettings(served_model_name="tiny", **settings))))


@pytest.fixture
def protected() -> Iterator[TestClient]:
    """A server with a key and ``--protect-probes``."""
    with client(api_key=KEY, open_probes=False) as protected:
        yield protected


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


@pytest.mark.parametrize("origin,method,says", [
    ("http://evil.example", "POST", "the origin 'http://evil.example' is not one that --allowed-origin names"),
    ("http://good.example", "PUT", "the method 'PUT' is not one a page of an allowed origin may send"),
])
def test_a_refused_cors_preflight_is_json_saying_why_and_is_counted(origin: str, method: str, says: str) -> None:
    """It was the text "Disallowed CORS origin", counted nowhere."""
    with client(api_key=KEY, allowed_origins=("http://good.example",)) as server:
        refused = server.options("/v1/chat/completions", headers={"Origin": origin,
                                                                  "Access-Control-Request-Method": method})
        metrics = server.get("/metrics").text
    assert refused.status_code == 400 and refused.headers["content-type"] == "application/json"
    error = refused.json()["error"]
    assert says in error["message"] and error["code"] == "cors_refused"
    assert 'pie:request_errors_total{status="400"} 1.0' in metrics


def test_protect_probes_keys_the_api_schema_too(protected: TestClient) -> None:
    """The schema lists the routes the server's options enabled (/v1/inferlets/runs: uploads of code are taken)."""
    refused = protected.get("/openapi.json")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "missing_api_key"
    assert protected.get("/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    with client(api_key=KEY) as open_probes:
        assert open_probes.get("/openapi.json").status_code == 200


OPEN_UNLESS_PROTECTED = ("/health", "/metrics", "/openapi.json", "/v1/pie/status", "/v1/pie/plan", "/", "/ui/*")


def test_the_protect_probes_help_names_every_path_it_keys() -> None:
    """It named /health and /metrics only: an operator did not learn that the page, status and plan (the model,
    device, load error, live counts) answer anyone without it."""
    serve = get_command(app).commands["serve"]
    help_text = next(param.help for param in serve.params if param.name == "protect_probes")
    open_rule = key_rule(ServeSettings(api_key=KEY))
    protected_rule = key_rule(ServeSettings(api_key=KEY, open_probes=False))
    for path in OPEN_UNLESS_PROTECTED:
        assert path in help_text, path
        assert open_rule(path.replace("*", "app.js")) == "open" != protected_rule(path.replace("*", "app.js")), path
    assert protected_rule("/v1/models") == open_rule("/v1/models") == "bearer"


def test_a_basic_key_on_the_api_is_refused_saying_the_api_takes_a_bearer_key(protected: TestClient) -> None:
    """A browser that was given the key for the page sends it as Basic on the chat too; the 401 said "this server
    needs an API key", as if none had come. Basic is never taken on the API (a cross-site request would carry it)."""
    basic = {"Authorization": "Basic " + base64.b64encode(f"me:{KEY}".encode()).decode()}
    assert protected.get("/v1/pie/status", headers=basic).status_code == 200
    for path in ("/v1/models", "/v1/chat/completions"):
        refused = protected.post(path, headers=basic, json={}) if "chat" in path else protected.get(path, headers=basic)
        error = refused.json()["error"]
        assert refused.status_code == 401 and error["code"] == "invalid_api_key", path
        assert "'Authorization: Bearer <key>', not as HTTP Basic" in error["message"]
        assert "www-authenticate" not in refused.headers  # a browser would ask for a password it then refuses
