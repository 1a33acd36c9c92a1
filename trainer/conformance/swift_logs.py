"""Reading ms-swift's GRPO logs (``logging.jsonl``, else the per-step dicts of its console log): each step's
reward, reward_std, loss and grad_norm, the steps' wall seconds, and whether GRPO had a learning signal."""

from __future__ import annotations

import contextlib
import re
from typing import Any

_LOG_DICT = re.compile(r"\{'[^{}]*\}")


def log_records(text: str) -> list[dict[str, Any]]:
    """ms-swift's per-step log lines in its console log (``{'loss': '0', 'grad_norm': '0', ..., 'global_step/
    max_steps': '1/3', ...}``, after the progress bar) as dicts, numbers as floats: the fallback when
    ``logging.jsonl`` is missing."""
    import ast

    out = []
    for m in _LOG_DICT.finditer(text):
        try:
            rec = ast.literal_eval(m.group(0))
        except (ValueError, SyntaxError):
            continue
        if not isinstance(rec, dict) or "global_step/max_steps" not in rec:
            continue
        for k, v in rec.items():
            with contextlib.suppress(TypeError, ValueError):
                rec[k] = float(v) if k != "global_step/max_steps" else v
        out.append(rec)
    return out


def _num(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def step_metrics(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per optimizer step of ms-swift's log records: reward (mean), reward_std, frac_reward_zero_std,
    loss, grad_norm, kl, and the mean/std of ``SIGNAL_REWARD``; ``varying_rewards``: the reward functions whose std
    over the step's completions was > 0."""
    out: dict[int, dict[str, Any]] = {}
    for rec in records:
        done = str(rec.get("global_step/max_steps", "")).split("/")[0]
        if not done.isdigit() or "train_runtime" in rec or not ("reward" in rec or "loss" in rec):
            continue
        row = {"step": int(done)}
        for k in ("reward", "reward_std", "frac_reward_zero_std", "loss", "grad_norm", "kl"):
            row[k] = _num(rec.get(k))
        row["signal_reward_mean"] = _num(rec.get("rewards/LengthDistinctReward/mean"))
        row["signal_reward_std"] = _num(rec.get("rewards/LengthDistinctReward/std"))
        row["varying_rewards"] = sorted(k.split("/")[1] for k, v in rec.items()
                                        if k.startswith("rewards/") and k.endswith("/std") and (_num(v) or 0.0) > 0)
        out[row["step"]] = row
    return [out[k] for k in sorted(out)]


def learning_signal(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether GRPO had anything to learn from: ``ok`` when there was a step and every step after the first (the
    only one when there is one) had reward_std > 0, grad_norm > 0 and (where logged) frac_reward_zero_std < 1 (at
    least one prompt whose completions scored differently; ``scale_rewards: batch`` makes reward_std the batch's, which
    is > 0 across prompts even when every group is flat); ``reason`` says which steps failed."""
    stds = [s["reward_std"] for s in steps if s.get("reward_std") is not None]
    checked = steps[1:] if len(steps) > 1 else steps
    bad = []
    for s in checked:
        why = []
        if not (s.get("reward_std") or 0.0) > 0:
            why.append(f"reward_std {s.get('reward_std')}")
        if not (s.get("grad_norm") or 0.0) > 0:
            why.append(f"grad_norm {s.get('grad_norm')}")
        if s.get("frac_reward_zero_std") is not None and s["frac_reward_zero_std"] >= 1.0:
            why.append("frac_reward_zero_std 1")
        if why:
            bad.append(f"step {s['step']}: " + ", ".join(why))
    ok = bool(checked) and not bad
    out: dict[str, Any] = {
        "steps": len(steps), "checked_steps": (f"{checked[0]['step']}..{checked[-1]['step']}" if checked else None),
        "reward_std_min": min(stds) if stds else None, "reward_std_max": max(stds) if stds else None,
        "nonzero_grad_norm_steps": sum(1 for s in steps if (s.get("grad_norm") or 0.0) > 0), "ok": ok}
    if not ok:
        out["reason"] = "; ".join(bad) if bad else "no GRPO step was logged"
    return out


def learning_signal_line(summary: dict[str, Any] | None, steps: list[dict[str, Any]]) -> str:
    """The check's one line about ``learning_signal`` (``None``: the run never got to ms-swift's logs): loud when
    it is not ok."""
    if summary is None:
        return "rlhf: NO LEARNING SIGNAL - the GRPO run did not get to its logs (see rlhf.failed)"
    per = "; ".join(f"step {s['step']}: reward {s['reward']} std {s['reward_std']} loss {s['loss']} "
                    f"grad_norm {s['grad_norm']}" for s in steps)
    if summary["ok"]:
        return (f"rlhf learning signal ok: reward_std {summary['reward_std_min']}..{summary['reward_std_max']}, "
                f"grad_norm > 0 in {summary['nonzero_grad_norm_steps']}/{summary['steps']} steps ({per})")
    return (f"rlhf: NO LEARNING SIGNAL - GRPO learned nothing in this run ({summary.get('reason')}); "
            f"per step: {per or 'none logged'}")


def step_seconds(records: list[dict[str, Any]]) -> list[float]:
    """Each optimizer step's wall seconds from ms-swift's ``logging.jsonl`` (``train_speed(s/it)`` is the running
    mean since the start, so step k took ``k * speed_k - (k-1) * speed_(k-1)``)."""
    elapsed = []
    for rec in records:
        done = str(rec.get("global_step/max_steps", "")).split("/")[0]
        if done.isdigit() and "train_speed(s/it)" in rec and "train_runtime" not in rec:
            elapsed.append((int(done), int(done) * float(rec["train_speed(s/it)"])))
    out, last = [], 0.0
    for _, total in sorted(elapsed):
        out.append(round(total - last, 3))
        last = total
    return out


def grpo_step_summary(steps: list[float], server: dict[str, float], records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per step: the learner's wall seconds (mean of steps 2.. when there are more than one: step 1 pays the
    warm-ups); the server's ``/infer/`` seconds over the run per step (ms-swift generates once per step here, and
    its connection check adds one short call, ~0.1 s, counted in) and seconds per weight sync (server side)."""
    timed = steps[1:] if len(steps) > 1 else steps
    gen = server["infer_s"] / len(steps) if steps else None
    sync = server["sync_s"] / server["syncs"] if server["syncs"] else None
    mean = sum(timed) / len(timed) if timed else None
    mem = [float(r["memory(GiB)"]) for r in records if "memory(GiB)" in r]
    return {"steps_s": steps, "step_s_mean": round(mean, 3) if mean else None,
            "steps_in_mean": f"{len(steps) - len(timed) + 1}..{len(steps)}" if timed else None,
            "generate_s_per_step": round(gen, 3) if gen else None, "infer_calls": int(server["infer_calls"]),
            "weight_sync_s_per_sync_server_side": round(sync, 3) if sync else None, "syncs": int(server["syncs"]),
            "generated_tokens": int(server["generated_tokens"]), "prompt_tokens": int(server["prompt_tokens"]),
            "rest_of_step_s": round(mean - (gen or 0.0) - (sync or 0.0), 3) if mean else None,
            "learner_peak_reserved_gib": max(mem) if mem else None}
