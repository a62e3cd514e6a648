"""The web page's JSON endpoints (/v1/pie/status, /v1/pie/plan) through the `openai` client, and who may read
the page: the same rule as /metrics, with HTTP Basic for a browser when the probes are protected."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from pie.runtime.llm import LLM
from pie.testing.serve_process import ServeProcess, wait_until

CHAT = [{"role": "user", "content": "Tell me about the fox and the paged cache."}]
KEY = "s3cret"


def api(server: ServeProcess, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)


def test_status_shows_the_numbers_metrics_shows(server: ServeProcess, client: openai.OpenAI) -> None:
    before = api(server).get("/pie/status", cast_to=object)
    metrics = server.metrics()
    assert before["phase"] == "ready" and before["model"] == "tiny" and before["error"] is None
    assert before["requests"] == {
        "running": metrics["pie:requests_running"],
        "waiting": metrics["pie:requests_waiting"],
        "inferlet_runs": metrics["pie:inferlet_runs"],
    }
    pages = before["kv_pages"]
    assert pages["total"] == metrics["pie:kv_pages_capacity"] == 4096 // pages["page_tokens"]
    assert (pages["used"], pages["cached"]) == (metrics["pie:kv_pages_used"], metrics["pie:kv_pages_cached"])
    assert (pages["host_total"], pages["host_used"]) == (0, 0) == (metrics["pie:kv_host_pages_capacity"],
                                                                   metrics["pie:kv_host_pages_used"])
    assert pages["free"] == pages["total"] - pages["used"] - pages["cached"]
    assert before["scheduler"] == {
        "steps": metrics["pie:scheduler_steps_total"],
        "batch_tokens": metrics["pie:batch_tokens_total"],
        "preemptions": metrics["pie:preemptions_total"],
    }

    replies = [client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, temperature=0)
               for _ in range(2)]
    after = api(server).get("/pie/status", cast_to=object)
    metrics = server.metrics()
    assert after["time"] >= before["time"]
    assert after["tokens"]["prompt"] - before["tokens"]["prompt"] == sum(r.usage.prompt_tokens for r in replies)
    assert after["tokens"]["generation"] - before["tokens"]["generation"] == 12
    assert after["tokens"] == {"prompt": metrics["pie:prompt_tokens_total"],
                               "generation": metrics["pie:generation_tokens_total"]}
    assert after["scheduler"]["steps"] > before["scheduler"]["steps"]
    prefix = after["prefix_cache"]
    assert prefix["enabled"] and prefix["hit_tokens"] == metrics["pie:prefix_cache_hits_total"] > 0  # the 2nd reused the 1st
    assert prefix["queried_tokens"] == metrics["pie:prefix_cache_queries_total"]
    assert prefix["hit_rate"] == pytest.approx(prefix["hit_tokens"] / prefix["queried_tokens"])
    assert after["requests"]["running"] == 0 and after["kv_pages"]["cached"] > 0


def test_plan_names_the_engine_device_profile_and_the_poem_plan(server: ServeProcess, tiny_model: Path) -> None:
    report = api(server).get("/pie/plan", cast_to=object)
    local = LLM.load(str(tiny_model), "cpu", max_cached_tokens=64)  # what `pie plan` loads and prints
    assert report["plan"] == local.runner.plan.describe() and report["plan"].startswith("Poem plan on cpu:0")
    assert report["engine"] == "cpu" and report["device"]["key"] == "cpu:0" and report["device"]["kind"] == "cpu"
    assert report["profile"] == local.profile_reason and report["model"] == "tiny"
    assert report["kv_tokens"] == 4096 and report["context_tokens"] == local.context_length
    assert "PIE_ENGINES" in report["engine_reason"]  # serve_process sets PIE_ENGINES=cpu


def test_the_endpoints_are_documented_in_the_openapi_schema(server: ServeProcess) -> None:
    schema = httpx.get(f"{server.url}/openapi.json", timeout=10).json()
    status = schema["paths"]["/v1/pie/status"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert status["$ref"].endswith("/Status")
    fields = schema["components"]["schemas"]["KVPages"]["properties"]
    assert "pie:kv_pages_cached" in fields["cached"]["description"]
    assert "/v1/pie/plan" in schema["paths"] and "/" not in schema["paths"]


def test_with_protected_probes_the_page_asks_a_browser_for_the_key(tiny_model: Path) -> None:
    args = ("--model", str(tiny_model), "--served-model-name", "tiny", "--protect-probes")
    with ServeProcess(*args, env={"PIE_API_KEY": KEY}) as server:
        missing = httpx.get(f"{server.url}/v1/pie/status", timeout=10)
        assert missing.status_code == 401 and "needs an API key" in missing.json()["error"]["message"]
        with pytest.raises(openai.AuthenticationError, match="incorrect API key"):
            api(server, "wrong").get("/pie/status", cast_to=object)
        refused = httpx.get(f"{server.url}/", timeout=10)
        assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Basic realm=")
        assert "www-authenticate" not in missing.headers  # the page asks for it itself, in its own dialog
        assert httpx.get(f"{server.url}/", auth=("", "wrong"), timeout=10).status_code == 401
        page = httpx.get(f"{server.url}/", auth=("any-user", KEY), timeout=10)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "script-src 'self'" in page.headers["content-security-policy"]
        script = httpx.get(f"{server.url}/ui/app.js", auth=("", KEY), timeout=10)
        assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
        assert httpx.get(f"{server.url}/ui/nothing.js", auth=("", KEY), timeout=10).status_code == 404
        assert wait_until(lambda: api(server, KEY).get("/pie/status", cast_to=object)["phase"] == "ready")
        # What a browser sends after its prompt opens the live view too; the chat still wants the bearer key.
        assert httpx.get(f"{server.url}/v1/pie/status", auth=("", KEY), timeout=10).json()["model"] == "tiny"
        chat = httpx.post(f"{server.url}/v1/chat/completions", auth=("", KEY), timeout=10,
                          json={"messages": CHAT, "max_tokens": 1})
        assert chat.status_code == 401
        assert server.stop() == 0


def test_no_ui_turns_the_page_off_but_not_the_status(tiny_model: Path) -> None:
    args = ("--model", str(tiny_model), "--served-model-name", "tiny", "--no-ui")
    with ServeProcess(*args, env={"PIE_API_KEY": KEY}) as server:
        server.wait_ready()
        for path in ("/", "/ui/app.js", "/ui/style.css"):
            response = httpx.get(f"{server.url}{path}", timeout=10)
            assert response.status_code == 404 and "no such path" in response.json()["error"]["message"]
        assert httpx.get(f"{server.url}/v1/pie/status", timeout=10).json()["phase"] == "ready"  # open probes: no key
        assert server.stop() == 0
