"""A benchmark table (``benchmarks/*.yaml``): one base trainer config and named variants, each a small override.

    model: 2b                 # the random Qwen3-VL the variants train (trainer.bench.models): tiny | 2b | 4b | 8b
    base:                     # a trainer config (``extends:`` a preset or values file as in any config file)
      training: {max_steps: 3, records_per_step: 64}
    fragments:                # named overrides a variant can extend with ``#name``
      auto-compile: {training: {gradient_checkpointing_policy: auto, compile_decoder_layers: true}}
    variants:
      - name: colocate-1
      - name: colocate-2
        learner_gpus: 2       # torchrun ranks, on the GPUs after the servers'
        baseline: colocate-1  # the variant its ratios are taken against (default: itself)
        config: {training: {records_per_step: 128}}          # deep-merged over base
      - name: colocate-1-auto-compile
        extends: "#auto-compile"                              # a fragment of this table
      - name: shipped
        extends: ../presets/colocate-4-2b-full.values.yaml#learner.config  # merged before ``config``; ``#a.b``: a key path

A learning table (``kind: learning``, ``trainer.bench.learning``) runs every variant at every one of its ``seeds``
(stage 1, stage 2, the held-out split scored after each); it has no ``model``: each variant's config names it
(``model.tiny`` or ``model.path``), and the runner writes no ``data.synthetic.num_samples``.

    kind: learning
    seeds: [0, 1, 2]
    base: {extends: ../configs/demo.yaml}
    variants:
      - name: hf
      - name: colocate
        config: {custom: {extra: {rollout_matching: {rollout_backend: vllm}}}}

A variant's config is ``base``, then its ``extends`` in order, then its ``config`` (mappings merge, everything else
replaces), then the keys the runner owns (``RUNNER_KEYS``). Every variant is validated by the training schema when
the table loads, before anything runs; a problem is one line naming the table, the variant and the key.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

import pydantic
import yaml
from pydantic import BaseModel, ConfigDict, Field

from trainer.config.errors import ConfigError, ConfigErrors
from trainer.config.loader import deep_merge, resolve_yaml
from trainer.config.schema import TrainConfig, validate_config

#: what the runner writes into every variant's config, whatever the table says
RUNNER_KEYS = ("model.path", "training.output_dir", "data.synthetic.num_samples",
               "custom.extra.rollout_matching.vllm.server.servers")


class BenchTableError(ValueError):
    """Problems of a table, one line each (``<table>: variant '<name>': <key>: <what to do>``)."""

    def __init__(self, lines: list[str]):
        self.lines = lines
        super().__init__("\n".join(lines))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServerSettings(_Strict):
    engine: Literal["vllm", "hf"] = "vllm"
    gpu_memory_utilization: float = Field(0.85, gt=0, lt=1)
    max_model_len: int = Field(4096, ge=256)


class Variant(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="the variant's name (--only picks it)")
    model: Literal["tiny", "2b", "4b", "8b"] | None = Field(None, description="the random Qwen3-VL (default: the table's)")
    learner_gpus: int = Field(1, ge=1, description="learner ranks (torchrun), each on a GPU of its own")
    servers: int = Field(0, ge=0, description="rollout servers (`trainer launch server`), one GPU each, before the learner's")
    baseline: str | None = Field(None, description="the variant this one's ratios are taken against")
    trl: bool | None = Field(None, description="TRL's GRPOTrainer beside this variant (default: the table's trl)")
    extends: str | list[str] = Field([], description="config files merged before `config` (`path#key.path`)")
    config: dict[str, Any] = Field({}, description="trainer config keys deep-merged over the base")
    server: ServerSettings | None = Field(None, description="its rollout servers' engine settings (default: the "
                                                            "table's `server`), e.g. a values file's `rolloutServer`")
    share_gpu: bool = Field(False, description="one server and a one-GPU learner on the same GPU (the server's "
                                               "gpu_memory_utilization leaves the learner its room)")

    @pydantic.model_validator(mode="after")
    def _sharing_fits(self):
        if self.share_gpu and (self.servers != 1 or self.learner_gpus != 1):
            raise ValueError("share_gpu: one server and one learner GPU share a GPU; set servers: 1, learner_gpus: 1")
        return self

    @property
    def gpus(self) -> int:
        return 1 if self.share_gpu else self.learner_gpus + self.servers


class Table(_Strict):
    kind: Literal["speed", "learning"] = Field("speed", description="speed: a random model's throughput; "
                                               "learning: held-out metrics before and after stage 2 over seeds")
    model: Literal["tiny", "2b", "4b", "8b"] | None = Field(
        None, description="the random Qwen3-VL a speed table trains (a learning table's configs name their model)")
    seeds: list[int] = Field([], description="a learning table: every variant runs at each of these seeds")
    base: dict[str, Any]
    fragments: dict[str, dict[str, Any]] = Field({}, description="named config overrides (`extends: '#name'`)")
    variants: list[Variant] = Field(min_length=1)
    trl: bool = Field(False, description="TRL's GRPOTrainer beside each one-GPU colocate variant (trainer.bench.trl_peer)")
    server: ServerSettings = ServerSettings()
    timeout_s: float = Field(900.0, gt=0, description="the most one variant's server start and learner may take")
    warmup_steps: int = Field(1, ge=1, description="optimizer steps left out of every mean")
    shared_warmup: bool = Field(
        False, description="a learning table: the base config's stage-1 warm-up runs once per seed "
        "(training.max_steps: 0, saved) and every variant at that seed starts stage 2 from its checkpoint "
        "(stage1.steps: 0), so variants differ in stage 2 alone")
    control: str | None = Field(
        None, description="a learning table: the variant every other is compared with at each seed (e.g. "
        "rollout_matching.targets: ground_truth), with a paired bootstrap interval over held-out images")
    parallel_seeds: bool = Field(
        False, description="a learning table on one GPU: the seeds run side by side (each seed's runs one after "
        "another), sharing the GPU; each run's engine share (vllm.gpu_memory_utilization) must leave room")
    bootstrap_draws: int = Field(2000, ge=100, description="paired bootstrap resamples of the held-out images")

    @pydantic.model_validator(mode="after")
    def _kind_fits(self):
        if self.kind == "speed" and self.model is None:
            raise ValueError("model: a speed table names the random Qwen3-VL it trains (tiny, 2b, 4b or 8b)")
        if self.kind == "learning":
            if self.model is not None:
                raise ValueError("model: a learning table trains the model its configs name (model.tiny or "
                                 "model.path); remove the table's model")
            if not self.seeds or len(set(self.seeds)) != len(self.seeds):
                raise ValueError("seeds: a learning table runs every variant at distinct seeds, e.g. [0, 1, 2]")
        elif self.seeds:
            raise ValueError("seeds: only a learning table (kind: learning) runs seeds")
        elif self.shared_warmup or self.control or self.parallel_seeds:
            raise ValueError("shared_warmup, control and parallel_seeds belong to a learning table (kind: learning)")
        return self


def server_settings(table: Table, variant: Variant) -> ServerSettings:
    """The engine settings ``variant``'s rollout servers start with: its own ``server``, else the table's."""
    return variant.server or table.server


def read_ref(ref: str, relative_to: Path, fragments: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The mapping ``ref`` names: ``#name``, a fragment of the table; a YAML file relative to ``relative_to`` with its
    ``extends`` resolved; or ``file#a.b``, the mapping at that key path inside it (a values file's
    ``learner.config``)."""
    path, _, keys = ref.partition("#")
    if not path:
        if keys not in (fragments or {}):
            raise ConfigError("extends", f"{ref}: no fragment {keys!r} in this table; its fragments: "
                                         f"{', '.join(fragments or {}) or 'none'}")
        return copy.deepcopy((fragments or {})[keys])
    data: Any = resolve_yaml(relative_to / path)
    for key in filter(None, keys.split(".")):
        if not isinstance(data, dict) or key not in data:
            raise ConfigError("extends", f"{ref}: no key {key!r} there")
        data = data[key]
    if not isinstance(data, dict):
        raise ConfigError("extends", f"{ref}: not a mapping")
    return copy.deepcopy(data)


def set_dotted(cfg: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for key in parents:
        cfg = cfg.setdefault(key, {})
    cfg[last] = value


def records_per_step(training: dict[str, Any], learner_gpus: int) -> int:
    """The records one optimizer step decodes and trains (``training.records_per_step``, else per-device batch x
    gradient accumulation x ranks), from a config's ``training`` mapping."""
    return int(training.get("records_per_step") or training.get("per_device_train_batch_size", 1)
               * training.get("gradient_accumulation_steps", 1) * learner_gpus)


def variant_config(table: Table, variant: Variant, where: Path, *, model_dir: str | None = None,
                   output_dir: str = "out", urls: list[str] | None = None, seed: int | None = None) -> dict[str, Any]:
    """``variant``'s trainer config as a plain mapping (not validated), the runner's keys filled in. A learning
    table's: at ``seed`` (default: its first), ``model.path`` only where ``model_dir`` is given (the model its
    servers load), its own sample counts."""
    refs = [variant.extends] if isinstance(variant.extends, str) else variant.extends
    cfg = copy.deepcopy(table.base)
    base_refs = cfg.pop("extends", [])
    for ref in ([base_refs] if isinstance(base_refs, str) else base_refs):
        cfg = deep_merge(read_ref(ref, where, table.fragments), cfg)
    for ref in refs:
        cfg = deep_merge(cfg, read_ref(ref, where, table.fragments))
    cfg = deep_merge(cfg, variant.config)
    learning = table.kind == "learning"
    if learning:
        from trainer.bench.learning import seed_config

        cfg = seed_config(cfg, table.seeds[0] if seed is None else seed)
    if model_dir is None and not learning:
        model_dir = "model"
    if model_dir is not None:
        set_dotted(cfg, "model.path", model_dir)
        if learning:
            cfg["model"].pop("tiny", None)
    set_dotted(cfg, "training.output_dir", output_dir)
    if variant.servers:
        urls = urls or [f"http://127.0.0.1:{8000 + i}" for i in range(variant.servers)]
        set_dotted(cfg, "custom.extra.rollout_matching.vllm.server.servers", [{"base_url": u} for u in urls])
    training = cfg.get("training", {})
    if "synthetic" in cfg.get("data", {}) and not learning:
        records = records_per_step(training, variant.learner_gpus)
        set_dotted(cfg, "data.synthetic.num_samples", records * (int(training.get("max_steps", 1)) + 1))
    return cfg


def _placement_errors(variant: Variant, cfg: TrainConfig) -> list[str]:
    rm = cfg.rollout_matching
    server_mode = rm.rollout_backend == "vllm" and rm.vllm is not None and rm.vllm.mode == "server"
    if variant.servers and not server_mode:
        return ["servers: rollout servers need custom.extra.rollout_matching.vllm.mode: server (and rollout_backend: "
                "vllm) in the variant's config"]
    if server_mode and not variant.servers:
        return ["custom.extra.rollout_matching.vllm.mode: server needs `servers: N` (N >= 1) on the variant"]
    return []


def _learning_errors(variant: Variant, cfg: TrainConfig) -> list[str]:
    lines = []
    if variant.model is not None:
        lines.append("model: a learning variant trains the model its config names (model.tiny or model.path)")
    if not cfg.data.has_eval_split or not cfg.training.eval_steps:
        lines.append("training.eval_steps: a learning run scores a held-out split after stage 1 and after stage 2: "
                     "set data.synthetic.eval_num_samples (or data.eval_jsonl) and training.eval_steps")
    if cfg.stage1.steps <= 0:
        lines.append("stage1.steps: a learning run starts stage 2 from a warm-up; set stage1.steps > 0")
    return lines


def _pydantic_lines(exc: pydantic.ValidationError, prefix: str, known: Any) -> list[str]:
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "(top level)"
        what = ("unknown key; known: " + ", ".join(known)) if err["type"] == "extra_forbidden" else \
            err["msg"].removeprefix("Value error, ")
        lines.append(f"{prefix}{key}: {what}")
    return lines


def load_table(path: str | Path) -> Table:
    """Read and check the table at ``path``: its own keys, unique names, known baselines, and every variant's config
    through ``validate_config``. ``BenchTableError`` lists every problem found."""
    path = Path(path)
    source = str(path)
    if not path.is_file():
        raise BenchTableError([f"{source}: no such benchmark table (the shipped ones are in benchmarks/)"])
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise BenchTableError([f"{source}: not valid YAML: {exc}"]) from None
    if not isinstance(raw, dict):
        raise BenchTableError([f"{source}: top level must be a mapping with model, base and variants"])
    raw_variants = raw.get("variants")
    if not isinstance(raw_variants, list) or not raw_variants:
        raise BenchTableError([f"{source}: variants: a list of at least one variant (name, and what it changes)"])
    lines: list[str] = []
    try:
        table = Table.model_validate({**raw, "variants": [{"name": "placeholder"}]})
    except pydantic.ValidationError as exc:
        raise BenchTableError(_pydantic_lines(exc, f"{source}: ", Table.model_fields)) from None
    variants = []
    for i, rv in enumerate(raw_variants):
        name = rv.get("name") if isinstance(rv, dict) else None
        try:
            variants.append(Variant.model_validate(rv))
        except pydantic.ValidationError as exc:
            lines += _pydantic_lines(exc, f"{source}: variant {name or '#' + str(i + 1)!r}: ", Variant.model_fields)
    table = table.model_copy(update={"variants": variants})
    names = [v.name for v in table.variants]
    lines += [f"{source}: variant {n!r}: name: used twice; give each variant its own name"
              for n in sorted({n for n in names if names.count(n) > 1})]
    if table.control is not None and table.control not in names:
        lines.append(f"{source}: control: {table.control!r} is not one of the variants ({', '.join(names)})")
    if table.shared_warmup and "warmup" in names:
        lines.append(f"{source}: variant 'warmup': name: with shared_warmup the warm-up runs are named warmup; "
                     "rename the variant")
    for v in table.variants:
        where = f"{source}: variant {v.name!r}: "
        if v.baseline is not None and v.baseline not in names:
            lines.append(f"{where}baseline: {v.baseline!r} is not a variant of this table")
        try:
            cfg = validate_config(variant_config(table, v, path.parent), source=f"{source} variant {v.name}")
        except ConfigError as exc:
            lines.append(f"{where}{exc}")
            continue
        except ConfigErrors as exc:
            lines.extend(f"{where}{e}" for e in exc.errors)
            continue
        lines.extend(where + line for line in _placement_errors(v, cfg))
        if table.kind == "learning":
            lines.extend(where + line for line in _learning_errors(v, cfg))
    if lines:
        raise BenchTableError(lines)
    return table


def select(table: Table, only: str | None) -> list[Variant]:
    """The variants ``only`` names (comma-separated, in that order), or every one in table order."""
    if not only:
        return list(table.variants)
    wanted = list(dict.fromkeys(n.strip() for n in only.split(",") if n.strip()))
    by_name = {v.name: v for v in table.variants}
    unknown = [n for n in wanted if n not in by_name]
    if unknown:
        raise BenchTableError([f"--only: no variant {', '.join(map(repr, unknown))} in this table; "
                               f"its variants: {', '.join(by_name)}"])
    return [by_name[n] for n in wanted]
