"""Run a stage-2 training job from a validated config: load → (stage-1 warm-up) → stage 2 → save + summary."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import TrainerCallback, TrainingArguments

from trainer.config.schema import TrainConfig
from trainer.data.records import JsonlDataset, LoadReport, index_jsonl
from trainer.data.synthetic import SYNTHETIC_JSONL, generate, scene_style
from trainer.extras import require
from trainer.loggers import close_loggers, open_loggers, require_loggers
from trainer.modeling.checkpointing import training_arguments_kwargs
from trainer.modeling.compile import compile_decoder_layers
from trainer.modeling.levers import apply_model_levers
from trainer.modeling.loading import LoadedModel, apply_tuner, check_adapter_can_learn_coords, load_model
from trainer.modeling.prompts import PromptEncoder
from trainer.packing.buffer import PackingBuffer
from trainer.packing.varlen_attention import choose_packed_attention
from trainer.precision import keep_master_weights_fp32, load_dtype
from trainer.rollout.factory import build_rollout_engine
from trainer.rollout.types import DecodingParams
from trainer.sft import deepspeed_config
from trainer.sft.checkpoint_files import STAGE2_DIR
from trainer.sft.cpu_threads import (
    apply_cpu_affinity,
    apply_cpu_threads,
    omp_wait_policy_in_effect,
    usable_physical_cores,
)
from trainer.sft.heap import freeze_setup_objects, install_first_step_freeze
from trainer.sft.metrics import LearnerMetrics, PrometheusCallback
from trainer.sft.settings import decoding_params, stage1_settings, stage2_settings
from trainer.sft.stage2 import MatchingSettings, Stage2Pipeline
from trainer.sft.target_workers import GroundTruthCollator, resolve_target_workers
from trainer.sft.trainer import JsonlMetricsCallback, RolloutMatchingTrainer, SampleDataset
from trainer.sync.policy import build_weight_sync
from trainer.telemetry import mirror_rows

log = logging.getLogger(__name__)


@dataclass
class RunSummary:
    output_dir: str
    stage1_steps: int
    stage2_steps: int
    stage2_seconds: float
    final_model_dir: str
    metrics_path: str


def parameter_count(model: torch.nn.Module) -> int:
    """The model's parameters, each tied tensor once (``parameters()`` yields it once) and a ZeRO-3 partitioned one at
    its full size (``ds_numel``)."""
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())


class StepRateCallback(TrainerCallback):
    """Adds ``speed/steps_per_s`` and ``speed/records_per_s`` (this rank's records) to each log row: optimizer steps
    since the previous row over the wall-clock time since it (the first row: since training began), everything
    included. Listed before the writers, which then see the keys."""

    def __init__(self, records_per_step: int):
        self.records_per_step = records_per_step
        self._mark: tuple[int, float] | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self._mark = (state.global_step, time.perf_counter())

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs or self._mark is None:
            return
        step0, t0 = self._mark
        now = time.perf_counter()
        if state.global_step > step0 and now > t0:
            rate = (state.global_step - step0) / (now - t0)
            logs["speed/steps_per_s"] = rate
            logs["speed/records_per_s"] = rate * self.records_per_step
        self._mark = (state.global_step, now)


def start_distributed() -> None:
    """Under torchrun (``WORLD_SIZE`` set) join the process group and take this rank's GPU now, before any engine
    starts: a colocated vLLM then runs under the external launcher on that group. (Started later, vLLM would open its
    own ``tcp://`` rendezvous, which torchrun's agent-store setting turns into a client waiting for a server that
    never comes: the hang at vLLM start.)"""
    if "WORLD_SIZE" in os.environ:
        import torch.distributed as dist
        from accelerate import PartialState

        if not dist.is_initialized():  # accelerate alone leaves a CPU (gloo) world uninitialised until HF's arguments
            if torch.cuda.is_available():
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
        PartialState()


@contextlib.contextmanager
def node_writes_first() -> Iterator[bool]:
    """Context yielding whether this process writes: the node's local main process runs the block first and writes,
    the other ranks run it after it and only read (one writer per node). Without torch.distributed: True."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        yield True
        return
    writer = int(os.environ.get("LOCAL_RANK", "0")) == 0
    if not writer:
        dist.barrier()  # the writer has finished
    yield writer
    if writer:
        dist.barrier()  # release the readers


def load_samples(cfg: TrainConfig) -> JsonlDataset:
    """The training records, checked in one streaming pass and indexed by line offset (each parsed when read). The
    synthetic set is written once per node (the local main rank; the others wait for it, then read it)."""
    d = cfg.data
    if d.synthetic is not None:
        s = d.synthetic
        data_dir = Path(cfg.training.output_dir) / "data"
        with node_writes_first() as writer:
            path = (generate(data_dir, s.num_samples, s.seed, s.min_objects, s.max_objects, s.image_size,
                             s.poly_fraction, style=scene_style(s)) if writer else data_dir / SYNTHETIC_JSONL)
        return index_jsonl(path)
    report = LoadReport()
    samples = index_jsonl(d.train_jsonl, d.image_root, on_bad_record=d.on_bad_record, report=report)
    log.info("dataset %s: %d samples kept (%d without objects), %d bad records dropped%s",
             d.train_jsonl, report.kept, report.negatives, len(report.dropped),
             "".join(f"; {kind}: {n}" for kind, n in sorted(report.notes.items())))
    out = Path(cfg.training.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "data_report.json").write_text(json.dumps(asdict(report), indent=2))
    return samples


def data_parallel_world_size() -> int:
    """The learner's data-parallel ranks: torchrun's ``WORLD_SIZE`` (1 for a plain ``python -m trainer train``)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def records_per_rank(records_per_step: int | None, batch_size: int, accumulation: int, world_size: int) -> int:
    """This rank's records per optimizer step: ``records_per_step / world_size`` (``training.records_per_step``), or
    ``batch_size x accumulation`` when it is None."""
    if records_per_step is None:
        return batch_size * accumulation
    if records_per_step % world_size:
        raise ValueError(f"training.records_per_step={records_per_step} is not a multiple of the data-parallel "
                         f"world size {world_size}: every rank decodes the same share; use a multiple of {world_size}")
    return records_per_step // world_size


def training_arguments(cfg: TrainConfig, output_dir: Path, *, max_steps: int, learning_rate: float,
                       batch_size: int, report_to: list[str], logging_steps: int | None = None,
                       step_records: bool = False, records_per_step: int | None = None,
                       bf16: bool | None = None, dataloader_workers: int | None = None) -> TrainingArguments:
    """HF's arguments; ``step_records``: for ``RolloutMatchingTrainer``, which gets a step's records
    (``records_per_step`` over all ranks, default ``batch_size`` x accumulation per rank) as HF's one micro-batch
    (``gradient_accumulation_steps`` 1) and accumulates the rows they fill itself. ``bf16``: None follows
    ``training.bf16``, on too where ``model.torch_dtype`` is bfloat16 without DeepSpeed (float32 master weights under
    bf16 autocast: ``trainer.precision``; float16 likewise turns on fp16); the warm-up passes its own,
    ``stage1.bf16``. ``dataloader_workers``: None follows
    ``training.dataloader_num_workers`` (the warm-up passes ``stage1.target_workers``). Checkpointing follows
    ``training.gradient_checkpointing_policy`` (``auto`` resolved first: ``trainer.modeling.levers``; the keyword is
    ``activation_checkpointing`` from transformers 5.2x), ``optim`` is ``training.optim``."""
    t = cfg.training
    master_autocast = cfg.model.torch_dtype if not t.deepspeed else None
    bf16_on = (t.bf16 or master_autocast == "bfloat16") if bf16 is None else bf16
    per_device, accumulation = batch_size, t.gradient_accumulation_steps
    if step_records:
        per_device = records_per_rank(records_per_step, batch_size, accumulation, data_parallel_world_size())
        accumulation = 1
    args = TrainingArguments(
        output_dir=str(output_dir),
        max_steps=max_steps,
        num_train_epochs=t.num_train_epochs,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        learning_rate=learning_rate,
        weight_decay=t.weight_decay,
        lr_scheduler_type=t.lr_scheduler_type,
        warmup_steps=t.warmup_ratio,
        max_grad_norm=t.max_grad_norm,
        logging_steps=logging_steps or t.logging_steps,
        save_strategy="steps" if t.save_steps else "no",
        save_steps=t.save_steps or 500,
        save_total_limit=t.save_total_limit,
        seed=t.seed,
        bf16=bf16_on,
        fp16=master_autocast == "float16" and not bf16_on,
        **training_arguments_kwargs(t, TrainingArguments.__dataclass_fields__),
        optim=t.optim,
        remove_unused_columns=False,
        dataloader_num_workers=t.dataloader_num_workers if dataloader_workers is None else dataloader_workers,
        report_to=report_to,
        disable_tqdm=t.disable_tqdm,
        deepspeed=deepspeed_config.resolve(t.deepspeed),
        use_cpu=not torch.cuda.is_available(),
    )
    return one_process_one_gpu(args)


def one_process_one_gpu(args: TrainingArguments) -> TrainingArguments:
    """A plain (non-torchrun) run on a machine with several visible GPUs trains on the first one: HF would wrap the
    model in ``nn.DataParallel``, whose replicas neither share a colocated engine nor expose their parameters (Qwen3-VL's
    vision tower then fails on ``self.visual.dtype``). Ranks come from ``launch learner`` / torchrun."""
    if data_parallel_world_size() == 1 and args.n_gpu > 1:
        log.warning("%d GPUs are visible but this is one process: training on cuda:0 only. To train on all of them "
                    "run `python -m trainer launch learner --config ... --gpus 0,1,...` (torchrun, one rank per GPU)",
                    args.n_gpu)
        args._n_gpu = 1
    return args


def packing_buffer(cfg: TrainConfig) -> PackingBuffer | None:
    """The packing of both stages (``training.packing``): the warm-up packs its ground-truth targets into
    ``training.packing_length`` rows as stage 2 packs its rollouts, so the rows the checkpointing policy was sized for
    are the rows it trains (a padded micro-batch of ``stage1.batch_size`` long targets is several rows' tokens in one
    forward)."""
    t = cfg.training
    return PackingBuffer(t.packing_length, t.packing_buffer, t.packing_min_fill_ratio) if t.packing else None


def build_pipeline(cfg: TrainConfig, loaded: LoadedModel) -> Stage2Pipeline:
    rm = cfg.rollout_matching
    weights = getattr(torch, cfg.model.torch_dtype, None)  # the base weights' dtype (a LoRA adapter's may differ)
    encoder = PromptEncoder(loaded.tokenizer, loaded.image_processor, cfg.data.system_prompt,
                            pixel_dtype=weights if weights in (torch.bfloat16, torch.float16) else None)
    settings = MatchingSettings(rm.matching.mask_iou_threshold, rm.matching.candidate_top_k,
                                rm.matching.mask_resolution, rm.poly.sinkhorn_epsilon, rm.poly.sinkhorn_iters,
                                rm.loss.tail_desc_ce, rm.matching.prefix)
    return Stage2Pipeline(encoder, settings)


def write_run_metadata(out: Path, cfg: TrainConfig, engine, weight_sync) -> dict:
    """Reproducibility metadata: backend, server list, effective sync mode, rollout seed."""
    rm = cfg.rollout_matching
    meta = {"rollout_backend": rm.rollout_backend, "vllm_mode": rm.vllm.mode if rm.rollout_backend == "vllm" else None,
            "rollout_seed": rm.decoding.seed, "decode_mode": "greedy" if rm.decoding.temperature <= 0 else "sampling"}
    if hasattr(engine, "metadata"):
        meta["engine"] = engine.metadata()
    if weight_sync is not None:
        meta["weight_sync"] = weight_sync.metadata()
    (out / "run_metadata.json").write_text(json.dumps(meta, indent=2, default=str))
    log.info("run metadata: %s", meta)
    return meta


def periodic_eval(cfg: TrainConfig, pipeline: Stage2Pipeline, engine, weight_sync, model, decoding: DecodingParams,
                  metrics_path: Path):
    """Held-out eval before stage 2 (after the warm-up), every ``training.eval_steps`` and at the end."""
    from trainer.evaluation.run import Evaluator, PeriodicEvalCallback, load_eval_samples

    evaluator = Evaluator(pipeline, engine, load_eval_samples(cfg), decoding,
                          top_k=cfg.rollout_matching.matching.candidate_top_k, weight_sync=weight_sync)
    return PeriodicEvalCallback(evaluator, model, cfg.training.eval_steps, cfg.training.output_dir, metrics_path,
                                tensorboard="tensorboard" in cfg.training.report_to)


def run_training(cfg: TrainConfig, resume_from_checkpoint: str | None = None) -> RunSummary:
    """``resume_from_checkpoint``: a stage-2 checkpoint folder or "latest"; the stage-1 warm-up is skipped."""
    if cfg.training.deepspeed:
        require("deepspeed", f"training.deepspeed ({cfg.training.deepspeed})")
    require_loggers(cfg.training.report_to)  # a missing W&B / MLflow library fails before anything starts
    start_distributed()
    cpu_affinity = apply_cpu_affinity(cfg.training.cpu_affinity)
    cpu_threads = apply_cpu_threads(cfg.training.cpu_threads_per_rank, bound=bool(cpu_affinity.cpus))
    out = Path(cfg.training.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    resolved = cfg.model_dump(mode="json")
    (out / "resolved_config.json").write_text(json.dumps(resolved, indent=2))
    # training.report_to's wandb / mlflow: every row of metrics.jsonl, whoever writes it, goes to them as written
    loggers = open_loggers(cfg.training.report_to, out, resolved)
    try:
        with mirror_rows(out / "metrics.jsonl", loggers):
            return _train(cfg, out, resume_from_checkpoint, cpu_threads, cpu_affinity)
    finally:
        close_loggers(loggers)


def save_final(trainer: RolloutMatchingTrainer, loaded: LoadedModel, final: Path) -> None:
    """The trained model as a checkpoint ``model.path`` can name: weights, tokenizer and image processor."""
    trainer.save_model(str(final))
    if loaded.image_processor is not None and trainer.args.should_save:
        loaded.image_processor.save_pretrained(str(final))


def _warm_up_only(cfg: TrainConfig, out: Path, warm: RolloutMatchingTrainer, loaded: LoadedModel, engine,
                  evaluator, metrics_path: Path, exporter) -> RunSummary:
    """``training.max_steps: 0``: the warm-up alone, scored on the held-out split once and saved to ``final/`` (a
    checkpoint every stage-2 variant and its control can start from, with ``stage1.steps: 0``)."""
    try:
        if evaluator is not None:
            evaluator.evaluate(warm.state)
    finally:
        engine.close()
        if exporter is not None:
            exporter.close()
    final = out / "final"
    save_final(warm, loaded, final)
    log.info("training.max_steps 0: the warm-up alone, saved to %s", final)
    summary = RunSummary(str(out), cfg.stage1.steps, 0, 0.0, str(final), str(metrics_path))
    (out / "run_summary.json").write_text(json.dumps(asdict(summary), indent=2))
    return summary


def _train(cfg: TrainConfig, out: Path, resume_from_checkpoint: str | None, cpu_threads, cpu_affinity) -> RunSummary:
    rm = cfg.rollout_matching
    torch.manual_seed(cfg.training.seed)
    samples = load_samples(cfg)
    with node_writes_first():  # the embedded tiny model is saved under output_dir once per node
        loaded = load_model(cfg.model, out, load_dtype(cfg.model.torch_dtype, cfg.tuner.train_type,
                                                       bool(cfg.training.deepspeed)))
    check_adapter_can_learn_coords(loaded, cfg.tuner)
    model = apply_tuner(loaded.model, cfg.tuner, loaded.multimodal)
    keep_master_weights_fp32(model, cfg.model.torch_dtype, deepspeed=bool(cfg.training.deepspeed))
    # Liger kernels, the checkpointing policy that runs (auto resolved) and the packed rows' attention, recorded as
    # metrics.jsonl's setup row
    packed_attn = (choose_packed_attention(cfg.model.attn_implementation, loaded.image_token_id is not None,
                                           cfg.training.packed_varlen_kernel) if cfg.training.packing else None)
    cfg, _ = apply_model_levers(cfg, model, out, data_parallel_world_size(), packed_attention=packed_attn,
                                cpu_threads=cpu_threads, cpu_affinity=cpu_affinity,
                                omp_wait_policy=omp_wait_policy_in_effect())
    if cfg.training.compile_decoder_layers:
        log.info("compiled %d decoder layers (training.compile_decoder_layers)", compile_decoder_layers(
            model, cfg.training.compile_activation_memory_budget))
    pipeline = build_pipeline(cfg, loaded)
    dataset = SampleDataset(samples)
    report = [r for r in cfg.training.report_to if r == "tensorboard"]  # HF's writer; jsonl, wandb, mlflow: ours
    metrics_path = out / "metrics.jsonl"
    decoding = decoding_params(cfg)
    common = dict(pipeline=pipeline, train_dataset=dataset, processing_class=loaded.tokenizer)
    engine = build_rollout_engine(rm, loaded, model)
    weight_sync = build_weight_sync(rm, engine, model)
    write_run_metadata(out, cfg, engine, weight_sync)
    stage2_callbacks = [JsonlMetricsCallback(str(metrics_path), "stage2")]
    stage1_callbacks = [JsonlMetricsCallback(str(metrics_path), "stage1")]
    exporter = None
    if cfg.training.metrics_port and int(os.environ.get("RANK", "0")) == 0:
        exporter = LearnerMetrics()
        exporter.watch_fleet(engine)
        exporter.serve(cfg.training.metrics_port, cfg.training.metrics_host)
        stage1_callbacks.append(PrometheusCallback(exporter, "stage1"))
        stage2_callbacks.append(PrometheusCallback(exporter, "stage2"))
    evaluator = periodic_eval(cfg, pipeline, engine, weight_sync, model, decoding, metrics_path) \
        if cfg.data.has_eval_split else None
    if evaluator is not None:
        stage2_callbacks.append(evaluator)
    if cfg.stage1.steps > 0 and not resume_from_checkpoint:
        s1 = cfg.stage1
        lr = s1.resolved_learning_rate(parameter_count(loaded.model), cfg.tuner.train_type)
        # a rank bound to its CPUs (training.cpu_affinity) spares workers from its own block; else from its share
        bound = cpu_affinity.cpus
        workers = resolve_target_workers(s1.target_workers, torch.cuda.is_available(),
                                         1 if bound else int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                                         len(bound) if bound else usable_physical_cores())
        log.info("stage 1: %d steps at learning rate %g (stage1.learning_rate: %s), targets built %s", s1.steps, lr,
                 s1.learning_rate, f"by {workers} loader workers" if workers else "in the step")
        warm = RolloutMatchingTrainer(
            model=model, args=training_arguments(cfg, out / "stage1", max_steps=s1.steps, learning_rate=lr,
                                                 batch_size=s1.batch_size, report_to=report,
                                                 logging_steps=s1.logging_steps, step_records=True,
                                                 bf16=s1.resolved_bf16(cfg.training.bf16, cfg.model.torch_dtype),
                                                 dataloader_workers=workers),
            engine=None, settings=stage1_settings(cfg, loaded.image_token_id, packed_attn),
            packing=packing_buffer(cfg), callbacks=[StepRateCallback(s1.batch_size), *stage1_callbacks],
            **({"data_collator": GroundTruthCollator(pipeline)} if workers else {}), **common)
        warm.train()
        if cfg.training.max_steps == 0:
            return _warm_up_only(cfg, out, warm, loaded, engine, evaluator, metrics_path, exporter)
    t = cfg.training
    packing = packing_buffer(cfg)
    try:
        trainer = RolloutMatchingTrainer(
            model=model, args=training_arguments(cfg, out / STAGE2_DIR, max_steps=cfg.training.max_steps,
                                                 learning_rate=cfg.training.learning_rate,
                                                 batch_size=cfg.training.per_device_train_batch_size,
                                                 report_to=report, step_records=True,
                                                 records_per_step=cfg.training.records_per_step),
            engine=engine, settings=stage2_settings(cfg, loaded.image_token_id, packed_attn),
            packing=packing, weight_sync=weight_sync, callbacks=stage2_callbacks, **common)
        if t.freeze_heap_after_first_step:
            install_first_step_freeze(trainer)
        freeze_setup_objects()
        result = trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    finally:
        gc.unfreeze()
        t_close = time.perf_counter()
        engine.close()
        log.info("closed the rollout engine in %.1f s", time.perf_counter() - t_close)
        if exporter is not None:
            exporter.close()
    final = out / "final"
    t_save = time.perf_counter()
    save_final(trainer, loaded, final)
    log.info("saved the final model to %s in %.1f s", final, time.perf_counter() - t_save)
    summary = RunSummary(str(out), cfg.stage1.steps, trainer.state.global_step, float(result.metrics.get("train_runtime", 0.0)),
                         str(final), str(metrics_path))
    (out / "run_summary.json").write_text(json.dumps(asdict(summary), indent=2))
    return summary
