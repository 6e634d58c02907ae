"""/metrics under vLLM's names with a ``model_name`` label (its Grafana dashboards work),
hybridkv's own under ``hybridkv:``, and the docs behind the API key."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_helpers import ENGINE_OPTIONS, MODEL_NAME, scrape, start_server, wait_idle

from hybridkv.engine import EngineConfig, LLMEngine

VLLM_NAMES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:num_preemptions_total",
    "vllm:time_to_first_token_seconds_count",
    "vllm:inter_token_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_count",
)
HYBRIDKV_NAMES = (
    "hybridkv:state_pages_used",
    "hybridkv:state_snapshots_taken_total",
    "hybridkv:state_snapshots_kept",
    "hybridkv:state_snapshots_evicted_total",
    "hybridkv:prefix_cache_hybrid_misses_total",
    "hybridkv:kv_capacity_tokens",
    "hybridkv:state_slots",
    "hybridkv:padding_waste_bytes",
    "hybridkv:unified_page_max_concurrency",
)
DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-hybridkv.json"


def test_vllm_metric_names_carry_the_model_name(client: Any, http: httpx.Client) -> None:
    client.completions.create(model=MODEL_NAME, prompt="metrics please", max_tokens=5)
    wait_idle(http)
    text = http.get("/metrics").text
    for name in VLLM_NAMES + HYBRIDKV_NAMES:
        line = re.search(rf"^{re.escape(name)}{{([^}}]*)}} ", text, re.M)
        assert line is not None, name
        assert f'model_name="{MODEL_NAME}"' in line[1] and 'engine="0"' in line[1], line[0]
    metrics = scrape(http)
    assert metrics['vllm:request_success_total{finished_reason="length"}'] >= 1
    assert metrics["vllm:e2e_request_latency_seconds_count"] >= 1
    assert metrics["vllm:inter_token_latency_seconds_count"] >= 4  # 5 tokens: 4 gaps or more
    assert 0 <= metrics["vllm:kv_cache_usage_perc"] <= 1
    binding = [k for k in metrics if k.startswith("hybridkv:max_concurrency{")]
    assert len(binding) == 1 and re.fullmatch(
        r'hybridkv:max_concurrency\{binding="(max_num_seqs|kv_cache|state)"\}', binding[0]
    )
    assert 'hybridkv:max_concurrency_bound{resource="kv_cache"}' in metrics


def test_capacity_metrics_are_the_startup_report(live: Any, http: httpx.Client) -> None:
    capacity = live.engine.stats()["capacity"]
    metrics = scrape(http)
    assert metrics["hybridkv:kv_capacity_tokens"] == capacity["kv_capacity_tokens"]
    assert metrics["hybridkv:state_slots"] == capacity["concurrency"]["state_bound"]
    c = capacity["concurrency"]
    assert metrics[f'hybridkv:max_concurrency{{binding="{c["binding"]}"}}'] == c["effective"]


def test_grafana_dashboard_uses_only_exported_metrics(http: httpx.Client) -> None:
    exported = {re.split(r"[{ ]", k)[0] for k in scrape(http)}
    exported |= {re.sub(r"_(bucket|count|sum)$", "", n) for n in exported}
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"\b((?:vllm|hybridkv):[a-z0-9_]+)", e)}
    assert used and used <= exported, used - exported
    assert all("model_name" in e for e in exprs)


@pytest.fixture(scope="module")
def secured(checkpoint: Path) -> Any:
    server = start_server(
        LLMEngine(EngineConfig(model=str(checkpoint), **ENGINE_OPTIONS)), api_key="s3cret"
    )
    yield server.base_url
    server.stop()


@pytest.mark.parametrize("path", ["/openapi.json", "/docs"])
def test_docs_need_the_api_key_when_one_is_set(secured: str, path: str) -> None:
    assert httpx.get(secured + path).status_code == 401
    good = httpx.get(secured + path, headers={"Authorization": "Bearer s3cret"})
    assert good.status_code == 200
    assert httpx.get(secured + "/metrics").status_code == 200  # scrapers stay keyless


def test_docs_are_open_without_a_key(http: httpx.Client) -> None:
    schema = http.get("/openapi.json")
    assert schema.status_code == 200 and "/v1/chat/completions" in schema.json()["paths"]
    assert "swagger" in http.get("/docs").text.lower()


def test_reset_prefix_cache_needs_the_api_key_and_empties_the_cache(secured: str) -> None:
    """vLLM's ``POST /reset_prefix_cache``, behind the key: afterwards a repeated prompt
    finds nothing cached, and no cached page is left."""
    auth = {"Authorization": "Bearer s3cret"}
    body = {
        "model": MODEL_NAME,
        "prompt": "A long shared system prompt that several requests reuse. " * 2,
        "max_tokens": 3,
        "temperature": 0,
    }

    def cached_tokens() -> int:
        response = httpx.post(secured + "/v1/completions", json=body, headers=auth, timeout=60)
        assert response.status_code == 200
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached_tokens()
    assert cached_tokens() > 0
    assert httpx.post(secured + "/reset_prefix_cache").status_code == 401
    wrong = {"Authorization": "Bearer wrong"}
    assert httpx.post(secured + "/reset_prefix_cache", headers=wrong).status_code == 401
    assert cached_tokens() > 0  # a refused reset changed nothing
    assert httpx.post(secured + "/reset_prefix_cache", headers=auth).status_code == 200
    with httpx.Client(base_url=secured) as http:
        metrics = scrape(http)
    cached_pages = [v for k, v in metrics.items() if k.startswith("hybridkv:pages_cached")]
    assert cached_pages and sum(cached_pages) == 0
    assert cached_tokens() == 0
    assert cached_tokens() > 0
