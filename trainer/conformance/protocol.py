"""What the conformance check compares: the raw answers of the endpoints both servers serve (status and field
shape), the routes each registers, the non-2xx answers in their access logs; ``findings`` lists every disagreement
with our protocol code."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

from trainer.conformance.peers import REPO, Peer, json_or_text, wait_health

_ACCESS = re.compile(r'"(GET|POST|PUT|DELETE|PATCH) (\S+) HTTP/[\d.]+" (\d{3})')


def access_log(text: str) -> list[dict[str, Any]]:
    """uvicorn access lines ``"POST /infer/ HTTP/1.1" 200`` → method, path, status (in order)."""
    return [{"method": m, "path": p, "status": int(s)} for m, p, s in _ACCESS.findall(text)]


def non_2xx(requests: list[dict[str, Any]], direction: str, server: str) -> list[dict[str, Any]]:
    seen: dict[tuple[str, str, int], int] = {}
    for r in requests:
        if not 200 <= r["status"] < 300:
            key = (r["method"], r["path"], r["status"])
            seen[key] = seen.get(key, 0) + 1
    return [{"direction": direction, "kind": "status", "detail": f"{server} answered {m} {p} with HTTP {s} ({n}x)"}
            for (m, p, s), n in seen.items()]


def _shape(value: Any, depth: int = 3) -> Any:
    """Field names (recursively, first list item) of a JSON answer: what the protocol comparison looks at."""
    if depth <= 0:
        return type(value).__name__
    if isinstance(value, dict):
        return {k: _shape(v, depth - 1) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [_shape(value[0], depth - 1)] if value else []
    return type(value).__name__


def probe_endpoints(url: str, timeout_s: float = 60.0) -> dict[str, Any]:
    """Raw answers (status, body, field shape) of the endpoints our client and ms-swift's client call before any
    sync: ``/health/``, ``/get_world_size/``, ``/get_engine_type/``, ``/get_model_state_keys/``, one ``/infer/``
    (our request body, ``return_details``) and ``/close_communicator/`` with no communicator open."""
    import httpx

    from trainer.rollout.server_client import infer_request, request_config
    from trainer.rollout.types import DecodingParams, RolloutRequest

    req = RolloutRequest("probe-0", ({"role": "user", "content": "probe"},), ())
    calls = [("GET", "/health/", None), ("GET", "/get_world_size/", None), ("POST", "/get_engine_type/", None),
             ("GET", "/get_model_state_keys/", None),
             ("POST", "/infer/", {"infer_requests": [infer_request(req)],
                                  "request_config": request_config(DecodingParams(max_new_tokens=4)),
                                  "metrics": None, "use_tqdm": None, "adapter_request": None}),
             ("POST", "/close_communicator/", None)]
    out: dict[str, Any] = {}
    with httpx.Client(timeout=timeout_s, trust_env=False) as c:
        for method, path, body in calls:
            try:
                r = c.request(method, url + path, json=body)
                answer = json_or_text(r)
                if path == "/get_model_state_keys/" and isinstance(answer, dict):
                    keys = answer.get("keys") or []
                    answer = {**answer, "keys": keys[:5] + (["…"] if len(keys) > 5 else [])}
                out[f"{method} {path}"] = {"status": r.status_code, "shape": _shape(answer),
                                           "body": answer if path != "/infer/" else None}
            except httpx.HTTPError as exc:
                out[f"{method} {path}"] = {"status": None, "error": f"{type(exc).__name__}: {exc}"}
    return out


def compare_probes(swift: dict[str, Any], ours: dict[str, Any]) -> list[dict[str, Any]]:
    """Where our server answers an endpoint differently from ``swift rollout`` (status code or field shape)."""
    found = []
    for key in sorted(set(swift) & set(ours)):
        a, b = swift[key], ours[key]
        if a.get("status") != b.get("status"):
            found.append({"direction": "both", "kind": "status",
                          "detail": f"{key}: swift rollout HTTP {a.get('status')}, ours HTTP {b.get('status')}"})
        elif a.get("shape") != b.get("shape"):
            found.append({"direction": "both", "kind": "fields", "detail": f"{key}: answers differ in shape",
                          "swift": a.get("shape"), "ours": b.get("shape")})
    return found


def started_and_probed(url: str, server: Peer, wait_s: float, r: dict[str, Any], save) -> bool:
    """Wait (at most ``wait_s``) for the peer's ``/health/``, then probe its endpoints; recorded in ``r`` (saved
    after each). False when it never came up (``r["failed"]["server_start"]`` says why)."""
    health = wait_health(url, server, wait_s)
    r["server"]["health"] = health
    save()
    if not health["ok"]:
        r["failed"]["server_start"] = health["error"]
        return False
    r["worked"].append("server_start")
    r["probes"] = probe_endpoints(url)
    save()
    return True


def _routes(source: str, pattern: str) -> set[str]:
    return {f"{m.upper()} {p}" for m, p in re.findall(pattern, source)}


def static_routes() -> dict[str, Any]:
    """Routes ``swift rollout`` registers (its source) vs routes our server registers (``trainer/server/app.py``)."""
    out: dict[str, Any] = {}
    spec = importlib.util.find_spec("swift")
    ours = _routes((REPO / "trainer/server/app.py").read_text(), r"@app\.(get|post)\(\"([^\"]+)\"")
    if spec is None or not spec.submodule_search_locations:
        return {"error": "ms-swift not installed"}
    src = Path(list(spec.submodule_search_locations)[0]) / "pipelines/infer/rollout.py"
    if not src.is_file():
        return {"error": f"{src} not found"}
    swift = _routes(src.read_text(), r"self\.app\.(get|post)\('([^']+)'")
    out["swift_rollout"] = sorted(swift)
    out["only_swift"] = sorted(swift - ours)
    out["only_ours"] = sorted(ours - swift)
    return out


def findings(result: dict[str, Any]) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    a, b = result.get("rollout", {}), result.get("rlhf", {})
    found += non_2xx(a.get("server", {}).get("requests", []), "rollout (our client -> swift rollout)", "swift rollout")
    found += non_2xx(b.get("server", {}).get("requests", []), "rlhf (swift rlhf -> our server)", "our server")
    if a.get("probes") and b.get("probes"):
        found += compare_probes(a["probes"], b["probes"])
    st = result.get("static_routes", {})
    for route in st.get("only_swift", []):
        found.append({"direction": "static", "kind": "route", "detail": f"swift rollout has {route}, our server not"})
    for name, err in a.get("failed", {}).items():
        if err and "answered HTTP" in str(err):
            found.append({"direction": "rollout (our client -> swift rollout)", "kind": "client", "detail":
                          f"{name}: {str(err)[:600]}"})
    return found
