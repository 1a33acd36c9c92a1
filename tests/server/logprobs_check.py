"""Shared check of ``/infer/`` log-probabilities against the model itself (HF and vLLM server tests)."""

from __future__ import annotations

import torch


def logprobs_body(messages, top: int | None, max_tokens: int = 6) -> dict:
    config = {"max_tokens": max_tokens, "temperature": 0.0, "logprobs": True, "return_details": True}
    if top is not None:
        config["top_logprobs"] = top
    return {"infer_requests": [{"messages": messages, "images": []}], "request_config": config}


def check_logprobs_against_model(item: dict, model, top: int | None, tol: float) -> None:
    """``item`` (one ``/infer/`` answer, greedy) carries one ``logprobs.content`` entry per new token, each the
    log-softmax of ``model``'s logits for that token given the prompt and the tokens before it (within ``tol``);
    greedy means the chosen token is the best of ``top_logprobs`` (when asked for)."""
    choice = item["response"]["choices"][0]
    ids, content = choice["token_ids"], choice["logprobs"]["content"]
    prompt = item["response"]["prompt_token_ids"]
    assert len(content) == len(ids) > 0
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float()
    expected = torch.log_softmax(logits, dim=-1)
    for t, (token, entry) in enumerate(zip(ids, content)):
        assert abs(entry["logprob"] - float(expected[t, token])) < tol, (t, entry["logprob"], float(expected[t, token]))
        assert entry["logprob"] <= 0.0 and isinstance(entry["token"], str)
        assert entry["bytes"] == list(entry["token"].encode("utf-8"))
        if top is None:
            assert "top_logprobs" not in entry
        else:
            best = entry["top_logprobs"]
            assert len(best) == top and [b["logprob"] for b in best] == sorted((b["logprob"] for b in best),
                                                                            reverse=True)
            assert abs(best[0]["logprob"] - entry["logprob"]) < 1e-6, "greedy: the chosen token is the most likely"
            top_ids = torch.topk(expected[t], top).indices.tolist()
            assert abs(best[-1]["logprob"] - float(expected[t, top_ids[-1]])) < tol
