"""The chart's `helm test` checker (trainer.deploy.smoke) against a local protocol-speaking HTTP server."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from trainer.deploy.smoke import check_server, main
from trainer.launch.ports import listen_port as _free_port  # below the ephemeral range

TEMPLATE = "configs/rollout_matching_sft_template.yaml"


def _server(world_size: int, health_status: int = 200):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            routes = {"/health/": (health_status, {"status": "ok"}), "/get_world_size/": (200, {"world_size": world_size})}
            status, body = routes.get(self.path, (404, {"detail": "Not Found"}))
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


@pytest.fixture
def servers():
    started = []

    def start(world_size, health_status=200):
        httpd = _server(world_size, health_status)
        started.append(httpd)
        return f"http://127.0.0.1:{httpd.server_address[1]}"

    yield start
    for httpd in started:
        httpd.shutdown()
        httpd.server_close()




def test_healthy_server_with_expected_world_size_passes(servers):
    assert check_server(servers(6), expect_world_size=6) == []


def test_wrong_world_size_is_reported(servers):
    url = servers(2)
    assert check_server(url, expect_world_size=6) == [f"{url}/get_world_size/ reports 2, expected 6 (tensor × data parallel)"]


def test_unhealthy_and_unreachable_servers_are_reported(servers):
    sick = servers(1, health_status=503)
    assert check_server(sick, 1) == [f"{sick}/health/ answered 503"]
    dead = f"http://127.0.0.1:{_free_port()}"
    (problem,) = check_server(dead, 1, timeout_s=2)
    assert problem.startswith(f"{dead}: unreachable")


def test_main_checks_config_and_every_server(servers, capsys, monkeypatch):
    from deploy_helpers import REPO

    monkeypatch.chdir(REPO)
    good, bad = servers(1), servers(3)
    assert main(["--config", TEMPLATE, "--servers", good, "--expect-world-size", "1"]) == 0
    assert "deployment check passed" in capsys.readouterr().out
    assert main(["--config", TEMPLATE, "--servers", f"{good},{bad}", "--expect-world-size", "1"]) == 1
    out = capsys.readouterr()
    assert f"FAIL {bad}" in out.out and "reports 3, expected 1" in out.err


def test_main_reports_an_invalid_config(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {tiny: text}\ndata: {synthetic: {}}\ntraining: {pakcing: true}\n")
    assert main(["--config", str(bad)]) == 1
    assert "training.pakcing" in capsys.readouterr().err
