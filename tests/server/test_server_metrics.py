"""Prometheus metrics of the rollout server (``GET /metrics``, ``trainer.server.metrics``): scraped over real HTTP
from a scripted-engine app after ``/infer/``, an accepted and a refused in-band update; guarded by the API key;
one registry per app; ``trainer serve --metrics-port`` serves them on a second port."""

from __future__ import annotations

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import save

INBAND = "/rm/update_weights_inband/?kind=full"


def scrape(http, url, **kw) -> dict[tuple[str, tuple], float]:
    r = http.get(url + "/metrics", **kw)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def value(samples, name, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def infer_body(n):
    return {"infer_requests": [{"messages": [{"role": "user", "content": f"Scene: item {i}"}], "images": [],
                                "uuid": f"s{i}"} for i in range(n)],
            "request_config": {"max_tokens": 8, "temperature": 0.0}}


def test_counters_move_with_infer_and_accepted_and_refused_updates(scripted_server, http, tiny_text_dir):
    with scripted_server(tiny_text_dir) as (url, engine):
        m0 = scrape(http, url)
        assert value(m0, "rm_server_weights_version") == 0
        assert value(m0, "rm_server_weight_updates_total", transport="inband", kind="full") == 0
        assert value(m0, "rm_server_weight_updates_refused_total") == 0
        assert value(m0, "rm_server_infer_in_flight") == 0
        assert value(m0, "rm_server_weights_info", version="initial", engine=engine.kind,
                     model=str(engine.model_name)) == 1

        items = http.post(url + "/infer/", json=infer_body(3)).json()
        new_tokens = sum(len(it["response"]["choices"][0]["token_ids"]) for it in items)
        prompt_tokens = sum(len(it["response"]["prompt_token_ids"]) for it in items)
        m1 = scrape(http, url)
        assert value(m1, "rm_server_rollout_requests_total") == 3
        assert value(m1, "rm_server_generated_tokens_total") == new_tokens > 0
        assert value(m1, "rm_server_prompt_tokens_total") == prompt_tokens > 0
        assert value(m1, "rm_server_infer_latency_seconds_count") == 1
        assert value(m1, "rm_server_infer_latency_seconds_sum") > 0
        assert value(m1, "rm_server_infer_in_flight") == 0
        assert value(m1, "rm_server_http_requests_total", endpoint="/infer/", status="200") == 1
        assert value(m1, "rm_server_http_requests_total", endpoint="/metrics", status="200") == 1

        state = {"model.norm.weight": torch.ones(engine.spec["model.norm.weight"].shape,
                                                 dtype=engine.spec["model.norm.weight"].dtype)}
        assert http.post(url + INBAND, content=save(state)).status_code == 200
        m2 = scrape(http, url)
        assert value(m2, "rm_server_weight_updates_total", transport="inband", kind="full") == 1
        assert value(m2, "rm_server_weights_version") == 1
        assert value(m2, "rm_server_weights_updated_timestamp_seconds") > 0
        assert value(m2, "rm_server_weights_info", version=engine.weights_version, engine=engine.kind,
                     model=str(engine.model_name)) == 1
        assert value(m2, "rm_server_weight_updates_refused_total") == 0
        assert value(m2, "rm_server_weight_sync_seconds_count", transport="inband") == 1
        assert value(m2, "rm_server_weight_sync_seconds_sum", transport="inband") > 0
        assert value(m2, "rm_server_weight_sync_seconds_count", transport="nccl") == 0

        bad = {"model.norm.weight": torch.full_like(state["model.norm.weight"], float("nan"))}
        r = http.post(url + INBAND, content=save(bad))
        assert r.status_code == 422, r.text
        m3 = scrape(http, url)
        assert value(m3, "rm_server_weight_updates_refused_total") == 1
        assert value(m3, "rm_server_weight_updates_total", transport="inband", kind="full") == 1
        assert value(m3, "rm_server_weights_version") == 1
        assert value(m3, "rm_server_weight_sync_seconds_count", transport="inband") == 1, "a refused sync is not timed"
        assert value(m3, "rm_server_http_requests_total", endpoint="/rm/update_weights_inband/", status="422") == 1
        assert value(m3, "rm_server_rollout_requests_total") == 3

        http.get(url + "/no/such/path")
        assert value(scrape(http, url), "rm_server_http_requests_total", endpoint="other", status="404") == 1


def test_metrics_need_the_api_key_and_each_app_has_its_own_registry(scripted_server, http):
    with scripted_server(api_key="sekret") as (url, _), scripted_server() as (other, _):
        assert http.get(url + "/metrics").status_code == 401
        assert http.get(url + "/health/").status_code == 200
        auth = {"Authorization": "Bearer sekret"}
        http.post(url + "/infer/", json=infer_body(2), headers=auth)
        assert value(scrape(http, url, headers=auth), "rm_server_rollout_requests_total") == 2
        assert value(scrape(http, other), "rm_server_rollout_requests_total") == 0


@pytest.mark.timeout(900)  # bounds a hang only (a server subprocess starts in ~10 s here)
def test_serve_metrics_port_serves_the_same_registry(get_free_port, http, trainer_serve):
    port, mport = get_free_port(), get_free_port()
    with trainer_serve(port, "--engine", "scripted", "--api-key-env", "RM_TEST_KEY", "--metrics-port", str(mport),
                       env={"RM_TEST_KEY": "k"}) as (url, _):
        auth = {"Authorization": "Bearer k"}
        assert http.post(url + "/infer/", json=infer_body(1), headers=auth).status_code == 200
        m = scrape(http, f"http://127.0.0.1:{mport}")  # no key on the metrics port
        assert value(m, "rm_server_rollout_requests_total") == 1
        assert httpx.get(url + "/metrics").status_code == 401
