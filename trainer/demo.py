"""``python -m trainer demo``: the embedded default end to end on CPU, then a readable report and a plot.

Runs the configured job (tiny model + synthetic data: stage-1 warm-up, then stage-2 rollout-matching),
then summarises ``metrics.jsonl`` into ``REPORT.md`` and ``losses.png`` in the output directory. Each figure names
its source: the stage-2 *training rollouts* (valid-object rate, matched / GT, FN, FP, the loss) or the *held-out
images* (the evaluation before and after stage 2). The held-out change in F1@0.5 is judged against the spread of
that change over seeds where one is recorded for the config (``SEED_SPREADS``).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from trainer.telemetry import read_jsonl

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"


@dataclass(frozen=True)
class SeedSpread:
    """Stage 2's change in held-out F1@0.5 over ``seeds`` runs of one config at different seeds: ``mean`` and
    sample standard deviation ``sd``; ``source``: where that was measured."""

    seeds: int
    mean: float
    sd: float
    source: str


#: config file → the spread recorded for it. configs/demo.yaml: seeds 0, 1, 2 on a 2-core x86-64 CPU, 2026-12-06
#: (docs/benchmarks/index.md, "The CPU demo: held-out metrics before and after stage 2"; docs/benchmarks/demo.json)
SEED_SPREADS = {
    DEFAULT_CONFIG: SeedSpread(3, 0.020, 0.036, "the CPU demo at seeds 0, 1, 2, 2026-12-06, docs/benchmarks/index.md"),
}

#: held-out metrics the report compares: (key, name, whether higher is better, shown as a percentage)
COMPARED = (("f1@50", "F1@0.5", True, False), ("ap", "AP 0.50:0.95", True, False),
            ("parse_failure_rate", "parse-failure rate", False, True))


def change_line(name: str, before: float, after: float, higher: bool, percent: bool) -> str:
    """``name: before → after (change; higher/lower is better)``; the change is that of the values as shown."""
    if percent:
        b, a = round(before * 100, 1), round(after * 100, 1)
        shown = f"{b:.1f}% → {a:.1f}% ({round(a - b, 1) + 0.0:+.1f} points"
    else:
        b, a = round(before, 3), round(after, 3)
        shown = f"{b:.3f} → {a:.3f} ({round(a - b, 3) + 0.0:+.3f}"
    return f"- {name}: {shown}; {'higher' if higher else 'lower'} is better)"


def seed_spread(config: str | Path) -> SeedSpread | None:
    """The spread recorded for this config file (``SEED_SPREADS``), or ``None``."""
    return SEED_SPREADS.get(Path(config).resolve())


def verdict(change: float, spread: SeedSpread | None, config: str | Path | None = None) -> str:
    """Whether a held-out change in F1@0.5 shows a gain, judged against ``spread`` (within ``±sd``: none shown)."""
    if spread is None:
        how = f"python -m trainer demo --config {config} --seed N" if config else "python -m trainer demo --seed N"
        return (f"F1@0.5 {change:+.3f}: no seed spread is recorded for this config, so this change cannot be told "
                f"from seed-to-seed variation; run it at 3 seeds (`{how}`, N = 0, 1, 2) to judge it.")
    within = f"the spread of {spread.seeds} seeds (±{spread.sd:.3f}; {spread.source})"
    if abs(change) <= spread.sd:
        return f"F1@0.5 {change:+.3f}: within {within}: no gain shown."
    return f"F1@0.5 {change:+.3f}: beyond {within}: {'a gain' if change > 0 else 'a loss'}."


@dataclass(frozen=True)
class DemoReport:
    stage1_steps: int
    stage2_steps: int
    valid_object_rate: float
    matched: int
    fn_appended: int
    fp: int
    gt: int
    first_loss: float
    last_loss: float
    loss_curve: tuple[float, ...]
    steps_per_s: float
    rollout_s: float
    forward_s: float
    backward_s: float
    wall_s: float
    # held-out eval rows (``eval/`` prefix stripped): (step, metrics) at the start of stage 2 (after the warm-up)
    # and at its end; empty when the config has no eval split
    evals: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    #: the spread of the held-out F1@0.5 change over seeds recorded for the config (``None``: none recorded)
    spread: SeedSpread | None = None
    config: str | None = None

    def eval_markdown(self) -> list[str]:
        """The held-out section: the table, each compared metric before → after with its change and which
        direction is better, and the verdict on F1@0.5 against the seeds' spread."""
        if len(self.evals) < 2:
            return []
        from trainer.evaluation.metrics import markdown_table

        (s0, before), (s1, after) = self.evals[0], self.evals[-1]
        changes = []
        for key, name, higher, percent in COMPARED:
            if key in before and key in after:
                changes.append(change_line(name, before[key], after[key], higher, percent))
            else:
                changes.append(f"- {name}: n/a")
        judged = ([verdict(after["f1@50"] - before["f1@50"], self.spread, self.config)]
                  if "f1@50" in before and "f1@50" in after else [])
        return [
            f"## Held-out evaluation ({before.get('num_samples', 0):.0f} held-out images, greedy): before vs after "
            "stage 2",
            "",
            markdown_table([(f"after stage-1 warm-up (stage-2 step {s0})", before),
                            (f"after stage 2 (step {s1})", after)]),
            "Stage 2's change on the held-out images:",
            "",
            *changes,
            "",
            *judged,
            "",
        ]

    def markdown(self) -> str:
        total = self.rollout_s + self.forward_s + self.backward_s or 1.0
        return "\n".join([
            "# rollout-matching demo report",
            "",
            f"- stage-1 warm-up steps: {self.stage1_steps}; stage-2 steps: {self.stage2_steps}",
            f"- stage-2 throughput: {self.steps_per_s:.2f} steps/s",
            f"- time split: rollout {self.rollout_s:.1f}s ({self.rollout_s / total:.0%}), forward {self.forward_s:.1f}s "
            f"({self.forward_s / total:.0%}), backward {self.backward_s:.1f}s ({self.backward_s / total:.0%})",
            f"- wall time (whole demo): {self.wall_s:.0f}s",
            "",
            f"## Stage-2 training rollouts (training images, all {self.stage2_steps} steps)",
            "",
            f"- valid-object rate of the rollouts: {self.valid_object_rate:.1%}",
            f"- rollout objects: matched {self.matched} / GT {self.gt}, FN appended {self.fn_appended}, FP {self.fp}",
            f"- training loss on their targets: first {self.first_loss:.3f} → last {self.last_loss:.3f}; curve "
            f"{sparkline(self.loss_curve)}",
            "",
            *self.eval_markdown(),
        ])


def sparkline(values: tuple[float, ...]) -> str:
    bars = "▁▂▃▄▅▆▇█"
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    return "".join(bars[int((v - lo) / span * (len(bars) - 1))] for v in values) + f" [{lo:.2f}..{hi:.2f}]"


def summarise(metrics_path: Path, wall_s: float, config: str | Path | None = None) -> DemoReport:
    """The report of a run's ``metrics.jsonl``; ``config``: the config file run (its seed spread, if recorded)."""
    rows = read_jsonl(metrics_path)
    s1 = [r for r in rows if r.get("phase") == "stage1" and "loss" in r]
    s2 = [r for r in rows if r.get("phase") == "stage2" and "loss" in r]
    if not s2:
        raise RuntimeError(f"no stage-2 log records in {metrics_path}")

    def total(key: str) -> float:
        return sum(r.get(key, 0.0) for r in s2)

    valid, invalid = total("rollout/valid_pred"), total("rollout/invalid_pred")
    step_s = total("time/step_s")
    evals = [(r["step"], {k.removeprefix("eval/"): v for k, v in r.items() if k.startswith("eval/")})
             for r in rows if r.get("phase") == "eval"]
    return DemoReport(
        stage1_steps=max((r["step"] for r in s1), default=0),
        stage2_steps=max(r["step"] for r in s2),
        valid_object_rate=valid / (valid + invalid) if valid + invalid else 0.0,
        matched=int(total("rollout/matched")),
        fn_appended=int(total("rollout/fn_appended")),
        fp=int(total("rollout/fp")),
        gt=int(total("rollout/gt")),
        loss_curve=tuple(r["loss"] for r in s2),
        first_loss=s2[0]["loss"],
        last_loss=s2[-1]["loss"],
        steps_per_s=len(s2) / step_s if step_s else 0.0,
        rollout_s=total("time/rollout_s"),
        forward_s=total("time/forward_s"),
        backward_s=total("time/backward_s"),
        wall_s=wall_s,
        evals=evals,
        spread=seed_spread(config) if config is not None else None,
        config=str(config) if config is not None else None,
    )


#: the held-out metrics the plot draws: (metrics.jsonl key, label)
HELD_OUT_CURVES = (("eval/f1@50", "F1 @ IoU 0.5"), ("eval/ap", "AP 0.50:0.95"), ("eval/ap50", "AP50"),
                   ("eval/recall@50", "recall @ 0.5"), ("eval/parse_failure_rate", "parse-failure rate"))


def data_limits(values: list[float], floor: float = 0.005) -> tuple[float, float]:
    """Axis limits around ``values`` (NaN ignored): their range padded by a tenth of it on each side, at least
    ``floor`` (a flat line stays visible); ``(0, 1)`` when there is no value."""
    finite = [v for v in values if v == v]
    if not finite:
        return 0.0, 1.0
    lo, hi = min(finite), max(finite)
    pad = max((hi - lo) / 10, floor)
    return lo - pad, hi + pad


def losses_figure(rows: list[dict]):
    """The figure of ``losses.png`` from a run's ``metrics.jsonl`` rows: the stage-1 and stage-2 training losses,
    the stage-2 training rollouts' counts per step and (when there are eval rows) the held-out metrics, on an axis
    scaled to their values."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    losses = [r for r in rows if "loss" in r]
    evals = [r for r in rows if r.get("phase") == "eval"]
    fig, axes = plt.subplots(1, 4 if evals else 3, figsize=(21 if evals else 16, 4))
    if evals:
        steps = [r["step"] for r in evals]
        drawn: list[float] = []
        for key, label in HELD_OUT_CURVES:
            values = [r.get(key, float("nan")) for r in evals]
            drawn += values
            axes[3].plot(steps, values, marker="o", label=label)
        axes[3].set_title(f"held-out images ({evals[0].get('eval/num_samples', 0):.0f}, greedy; step 0 = after "
                          "stage 1)")
        axes[3].set_xlabel("stage-2 optimizer step")
        axes[3].set_ylim(*data_limits(drawn))
        axes[3].legend(fontsize=8)
    s2 = [r for r in losses if r["phase"] == "stage2"]
    for key, label in (("rollout/matched", "matched"), ("rollout/fn_appended", "FN appended"), ("rollout/fp", "FP"),
                       ("rollout/invalid_pred", "invalid objects")):
        axes[2].plot([r["step"] for r in s2], [r.get(key, 0) for r in s2], label=label)
    axes[2].set_title("stage-2 training rollouts (objects per step)")
    axes[2].set_xlabel("optimizer step")
    axes[2].legend(fontsize=8)
    for ax, phase in zip(axes, ("stage1", "stage2")):
        pr = [r for r in losses if r["phase"] == phase]
        steps = [r["step"] for r in pr]
        for key, label in (("loss", "total"), ("loss/ce", "CE"), ("loss/coord_softce", "coord soft-CE"),
                           ("loss/coord_w1", "coord W1"), ("loss/coord_gate", "coord gate")):
            if pr and key in pr[0]:
                ax.plot(steps, [r[key] for r in pr], label=label)
        ax.set_title(f"{phase.replace('stage', 'stage-')} training losses")
        ax.set_xlabel("optimizer step")
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_losses(metrics_path: Path, out_png: Path) -> None:
    """``losses_figure`` of ``metrics_path`` saved as ``out_png``."""
    import matplotlib.pyplot as plt

    fig = losses_figure(read_jsonl(metrics_path))
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def pin_determinism(threads: int, deterministic_algorithms: bool = True) -> None:
    """What can be pinned across machines: intra-op threads (reduction splits), deterministic algorithms, and
    (in run_training / the HF Trainer) the seeds. CPU kernels still differ by instruction set and library build;
    docs/quickstart/cpu-demo.md says what varies and why. ``deterministic_algorithms`` is off for a vLLM backend:
    vLLM compiles its model with Inductor, which refuses to start in torch's deterministic mode."""
    import torch

    torch.set_num_threads(threads)
    if deterministic_algorithms:
        torch.use_deterministic_algorithms(True, warn_only=True)


def apply_seed(cfg, seed: int) -> None:
    """One seed for everything a run draws: the training seed, the tiny model's initial weights and the synthetic
    data (its held-out split is ``seed + 1``), so that runs at seeds 0, 1, 2 are independent replicates."""
    cfg.training.seed = seed
    if cfg.model.tiny is not None:
        cfg.model.tiny_seed = seed
    if cfg.data.synthetic is not None:
        cfg.data.synthetic.seed = seed


def run(args: argparse.Namespace) -> int:
    from trainer.config.cli import load_or_report
    from trainer.sft.run import run_training

    cfg = load_or_report(args.config)
    if cfg is None:
        return 2
    rm = cfg.custom.extra.rollout_matching
    pin_determinism(args.threads, deterministic_algorithms=rm is None or rm.rollout_backend == "hf")
    if args.output_dir:
        cfg.training.output_dir = args.output_dir
    if getattr(args, "seed", None) is not None:
        apply_seed(cfg, args.seed)
    out = Path(cfg.training.output_dir)
    metrics = out / "metrics.jsonl"
    if metrics.exists():
        metrics.unlink()
    start = time.time()
    from trainer.modeling.loading import ModelPathError

    try:
        run_training(cfg)
    except ModelPathError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report = summarise(metrics, time.time() - start, args.config)
    plot_losses(metrics, out / "losses.png")
    text = report.markdown() + f"\nPlot: {out / 'losses.png'}\nMetrics: {metrics}\n"
    if report.evals:
        text += f"Held-out evals (metrics.json, metrics.md, samples.jsonl per step): {out / 'eval'}/step-*\n"
    (out / "REPORT.md").write_text(text)
    print("\n" + text)
    if report.matched == 0:
        print("warning: no rollout object matched a ground-truth object", file=sys.stderr)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("demo", help="run the embedded default on CPU and print a report")
    p.add_argument("--config", default=str(DEFAULT_CONFIG))
    p.add_argument("--output-dir", default=None)
    p.add_argument("--seed", type=int, default=None,
                   help="run at this seed: training.seed, model.tiny_seed and data.synthetic.seed (held-out: seed + 1) "
                        "all set to it, so seeds 0, 1, 2 are independent replicates (default: the config's)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads, pinned so runs on machines with different core counts split "
                        "reductions alike and no OpenMP spin-waits on a busy machine (default 1)")
    p.set_defaults(func=run)
