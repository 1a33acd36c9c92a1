"""A learning table (``kind: learning``): does stage 2 make the detector better, at every seed and on every backend?

Each variant (a backend, a learning rate, ...) runs at every seed of the table's ``seeds``: the stage-1 warm-up, then
stage 2, with the held-out split scored after each (``training.eval_steps`` and the config's eval split). A record
holds the held-out metrics after stage 1 and after stage 2, their difference, the times and the mismatch between
the engine's and the learner's log-probabilities; ``summarise`` gives each variant's mean and spread over its seeds.

Seeds are applied as ``trainer demo --seed`` applies them (``seed_config``): the training seed, the tiny model's
initial weights and the synthetic data (held-out: ``seed + 1``), so the seeds are independent replicates.
"""

from __future__ import annotations

import copy
import statistics
from pathlib import Path
from typing import Any

from trainer.telemetry import read_jsonl

#: the held-out metrics a record keeps (``eval/`` rows of metrics.jsonl)
EVAL_KEYS = ("f1@50", "precision@50", "recall@50", "ap", "ap50", "parse_failure_rate", "invalid_object_rate",
             "num_samples")
#: the differences the summary gives a mean and spread of
DELTA_KEYS = ("f1@50", "ap", "parse_failure_rate")


def seed_config(cfg: dict[str, Any], seed: int) -> dict[str, Any]:
    """``cfg`` (a plain config mapping) at ``seed``: ``training.seed``, ``model.tiny_seed`` (an embedded tiny model)
    and ``data.synthetic.seed`` (synthetic data) set to it."""
    out = copy.deepcopy(cfg)
    out.setdefault("training", {})["seed"] = seed
    if out.get("model", {}).get("tiny"):
        out["model"]["tiny_seed"] = seed
    if isinstance(out.get("data", {}).get("synthetic"), dict):
        out["data"]["synthetic"]["seed"] = seed
    return out


def backend_of(cfg: dict[str, Any]) -> str:
    """``hf``, ``vllm-colocate`` or ``vllm-server``, from a config mapping."""
    rm = cfg.get("custom", {}).get("extra", {}).get("rollout_matching", {})
    if rm.get("rollout_backend", "vllm") == "hf":
        return "hf"
    return f"vllm-{rm.get('vllm', {}).get('mode', 'colocate')}"


def _phase_span(rows: list[dict[str, Any]], phase: str) -> float | None:
    times = [r["time"] for r in rows if r.get("phase") == phase and isinstance(r.get("time"), (int, float))]
    return max(times) - min(times) if len(times) > 1 else None


def learning_record(run_dir: Path) -> dict[str, Any]:
    """What a finished run learned, from its ``metrics.jsonl``: ``after_stage1`` (the first held-out eval, before any
    stage-2 step), ``after_stage2`` (the last), ``delta`` (after minus before), the stage-2 mismatch (mean of the
    logged steps' means, the largest max, mean k3) and the phases' wall times. A run without two evals raises:
    its config needs an eval split and ``training.eval_steps``."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    evals = [r for r in rows if r.get("phase") == "eval"]
    if len(evals) < 2:
        raise RuntimeError(f"{run_dir}/metrics.jsonl has {len(evals)} held-out evals; a learning run needs one "
                           "after stage 1 and one after stage 2 (data.synthetic.eval_num_samples or "
                           "data.eval_jsonl, and training.eval_steps)")

    def metrics(row: dict[str, Any]) -> dict[str, float]:
        return {k: row[f"eval/{k}"] for k in EVAL_KEYS if f"eval/{k}" in row}

    before, after = metrics(evals[0]), metrics(evals[-1])
    stage2 = [r for r in rows if r.get("phase") == "stage2" and "loss" in r]
    first = stage2[0] if stage2 else {}
    peaks = [v for r in rows for k, v in r.items() if k.startswith("mem/") and k.endswith("_peak_gib")
             and isinstance(v, (int, float))]
    step_s = [r["time/step_wall_s"] for r in stage2[1:] if isinstance(r.get("time/step_wall_s"), (int, float))]
    means = [r["mismatch/logp_abs_diff_mean"] for r in stage2 if "mismatch/logp_abs_diff_mean" in r]
    maxes = [r["mismatch/logp_abs_diff_max"] for r in stage2 if "mismatch/logp_abs_diff_max" in r]
    k3 = [r["mismatch/kl_k3"] for r in stage2 if "mismatch/kl_k3" in r]
    return {
        "after_stage1": before, "after_stage2": after,
        "delta": {k: after[k] - before[k] for k in EVAL_KEYS if k in before and k in after and k != "num_samples"},
        "held_out": int(after.get("num_samples", 0)),
        "stage1_steps": max((r["step"] for r in rows if r.get("phase") == "stage1"), default=0),
        "stage2_steps": max((r["step"] for r in stage2), default=0),
        "stage1_wall_s": _phase_span(rows, "stage1"), "stage2_wall_s": _phase_span(rows, "stage2"),
        "first_step_truncated": (first["rollout/truncated"] / first["rollout/samples"]
                                 if first.get("rollout/samples") else None),
        "stage2_step_s": statistics.fmean(step_s) if step_s else None,
        "peak_gib": max(peaks) if peaks else None,
        "mismatch": ({"logp_abs_diff_mean": statistics.fmean(means), "logp_abs_diff_max": max(maxes),
                      "kl_k3": statistics.fmean(k3) if k3 else None, "steps": len(means)} if means else None),
    }


def _spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "n": len(values)}


def summarise(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per variant, over the seeds that finished: mean, standard deviation, min and max of F1@0.5 and AP after each
    stage and of their differences, the mismatch mean, and ``helps_at_every_seed`` (stage 2 raised F1@0.5 at each
    seed); a variant with a failed seed says which."""
    out: dict[str, dict[str, Any]] = {}
    for variant in dict.fromkeys(r["variant"] for r in records):
        mine = [r for r in records if r["variant"] == variant]
        done = [r for r in mine if "error" not in r]
        s: dict[str, Any] = {"seeds": [r["seed"] for r in done], "failed_seeds": [r["seed"] for r in mine
                                                                                    if "error" in r]}
        if done:
            s["backend"] = done[0]["backend"]
            for stage in ("after_stage1", "after_stage2"):
                s[stage] = {k: _spread([r[stage][k] for r in done]) for k in ("f1@50", "ap")
                            if all(k in r[stage] for r in done)}
            s["delta"] = {k: _spread([r["delta"][k] for r in done]) for k in DELTA_KEYS
                          if all(k in r["delta"] for r in done)}
            s["helps_at_every_seed"] = all(r["delta"].get("f1@50", 0.0) > 0 for r in done)
            mm = [r["mismatch"]["logp_abs_diff_mean"] for r in done if r.get("mismatch")]
            s["mismatch_logp_abs_diff_mean"] = _spread(mm) if mm else None
        out[variant] = s
    return out


def markdown(summary: dict[str, dict[str, Any]]) -> str:
    """The summary as a table: mean ± standard deviation over the seeds."""

    def pm(cell: dict[str, float] | None, digits: int = 3) -> str:
        return f"{cell['mean']:+.{digits}f} ± {cell['std']:.{digits}f}" if cell else "n/a"

    def plain(cell: dict[str, float] | None) -> str:
        return f"{cell['mean']:.3f} ± {cell['std']:.3f}" if cell else "n/a"

    lines = ["| variant | backend | seeds | F1@0.5 after stage 1 | after stage 2 | Δ F1@0.5 | Δ AP | mismatch (nats) |",
             "|---|---|---|---|---|---|---|---|"]
    for name, s in summary.items():
        if not s["seeds"]:
            lines.append(f"| {name} | | failed at {s['failed_seeds']} | | | | | |")
            continue
        mm = s.get("mismatch_logp_abs_diff_mean")
        mismatch = f"{mm['mean']:.2g}" if mm else "n/a"
        lines.append(f"| {name} | {s['backend']} | {len(s['seeds'])} | {plain(s['after_stage1'].get('f1@50'))} | "
                     f"{plain(s['after_stage2'].get('f1@50'))} | {pm(s['delta'].get('f1@50'))} | "
                     f"{pm(s['delta'].get('ap'))} | {mismatch} |")
    return "\n".join(lines) + "\n"


def eval_samples(run_dir: Path) -> list[Path]:
    """A run's held-out ``samples.jsonl`` files, in step order (``eval/step-NNNNNN/``)."""
    return sorted(Path(run_dir).glob("eval/step-*/samples.jsonl"))


def warmup_record(run_dir: Path) -> dict[str, Any]:
    """A shared warm-up run (``training.max_steps: 0``): its one held-out eval as ``after_stage1``, its steps and wall
    time."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    evals = [r for r in rows if r.get("phase") == "eval"]
    if not evals:
        raise RuntimeError(f"{run_dir}/metrics.jsonl has no held-out eval; a warm-up needs an eval split")
    return {"after_stage1": {k: evals[-1][f"eval/{k}"] for k in EVAL_KEYS if f"eval/{k}" in evals[-1]},
            "held_out": int(evals[-1].get("eval/num_samples", 0)),
            "stage1_steps": max((r["step"] for r in rows if r.get("phase") == "stage1"), default=0),
            "stage1_wall_s": _phase_span(rows, "stage1")}


def compare_runs(records: list[dict[str, Any]], runs_root: Path, control: str | None,
                 draws: int = 2000) -> list[dict[str, Any]]:
    """Per seed and variant: stage 2 − stage 1 (the variant's last held-out eval against the warm-up's, or its own
    first eval without a shared warm-up) and, with a ``control`` variant, the variant − the control; each with a
    paired bootstrap 95 % interval over the held-out images (``trainer.evaluation.bootstrap``)."""
    from trainer.evaluation.bootstrap import load_matches, paired_bootstrap

    out: list[dict[str, Any]] = []
    by_seed: dict[int, dict[str, dict[str, Any]]] = {}
    for r in records:
        by_seed.setdefault(r["seed"], {})[r["variant"]] = r
    for seed, runs in sorted(by_seed.items()):
        last = {name: eval_samples(runs_root / r["name"]) for name, r in runs.items()}
        for name, files in last.items():
            if name == "warmup" or not files:
                continue
            stage1 = last.get("warmup") or files
            mine = load_matches(files[-1])
            pairs = [("stage 1", stage1[0])]
            if control and name != control and last.get(control):
                pairs.append((control, last[control][-1]))
            for against, other in pairs:
                ci = paired_bootstrap(mine, load_matches(other), draws=draws, seed=seed)
                out.append({"seed": seed, "variant": name, "against": against,
                            **{k: v.to_json() for k, v in ci.items()}})
    return out


def comparisons_markdown(comparisons: list[dict[str, Any]]) -> str:
    """Each comparison as a row: the difference and its 95 % interval for F1@0.5 and AP."""
    lines = ["| seed | variant | − | Δ F1@0.5 [95 % CI] | Δ AP [95 % CI] |", "|---|---|---|---|---|"]
    for c in comparisons:
        cells = [f"{c[k]['diff']:+.3f} [{c[k]['low']:+.3f}, {c[k]['high']:+.3f}]" for k in ("f1@50", "ap")]
        lines.append(f"| {c['seed']} | {c['variant']} | {c['against']} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n"
