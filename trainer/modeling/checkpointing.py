"""``training.gradient_checkpointing_policy``: which decoder layers recompute their forward in the backward.

``full``: every layer (HF's gradient checkpointing, what ``gradient_checkpointing: true`` always did). ``selective``:
every ``gradient_checkpointing_every_n_layers``-th layer (default 2), through HF's own ``every_n_layers`` (transformers
5.17 and 5.19: ``TrainingArguments.gradient_checkpointing_kwargs={"every_n_layers": n}``, popped by the Trainer
before ``torch.utils.checkpoint``); the layers in between keep their activations, so a step recomputes 1/n of the
forward instead of all of it and holds about (1 - 1/n) of the un-checkpointed activations. HF counts every
``GradientCheckpointingLayer`` of the model in module order, vision blocks included (frozen, they save nothing), so
on Qwen3-VL the checkpointed text layers are every n-th from an offset (``checkpointed_decoder_layers`` names them).
``off``: none. ``auto``: ``choose_checkpointing`` at start-up, from the estimate below; with compiled layers and
``training.compile_activation_memory_budget: auto`` it first tries no checkpointing at each of ``AUTO_MEMORY_BUDGETS``
(the partitioner recomputing part of each layer instead).

The estimate (``choose_checkpointing``, pure). Activations a decoder layer keeps for its backward, per token, in the
activation dtype (``activation_bytes_per_token_per_layer``), counting the tensors autograd saves in HF's Qwen3 /
Qwen3-VL layer with SDPA / flash attention (no attention-score matrix)::

    bytes = dtype_bytes x (8 h + 8 q + 7 kv + 4 i)

h: hidden size (two RMSNorms save their fp32 input, rsqrt and output: 3 h each, plus the projections' shared input:
h each), q = heads x head_dim (q_norm 3 q, RoPE 2 q, attention's q and output, o_proj's input), kv = kv heads x
head_dim (k_norm 3 kv, RoPE 2 kv, attention's k and v), i: intermediate size (gate, up, silu(gate), their product).
Qwen3-VL at 16k packed tokens, bf16: 2B 126 KiB a token a layer, 55 GiB for its 28 layers; 4B 194 KiB, 109 GiB
(36); 8B 238 KiB, 134 GiB (36).

Compiled layers (``training.compile_decoder_layers``) keep less: Inductor's partitioner keeps bf16 tensors only (no
fp32 norm copies) and recomputes the element-wise rest, about three tensors of each width
(``compiled_activation_bytes_per_token_per_layer``)::

    bytes = dtype_bytes x (budget x 3 (h + q + kv + i) + h)

(3 (h + q + kv + i): counted on the CPU with saved-tensor hooks around a compiled Qwen3-VL text layer at the 2B, 4B
and 8B shapes; ``h``: the layer's input; ``budget``: ``training.compile_activation_memory_budget``, which the
partitioner keeps at or under: 0.5 kept 0.50 and 0.2 kept 0.17 of the default at 4B.) 4B: 107 KiB a token a layer
at budget 1, 46 KiB at 0.4 (eager: 194).

A forward over ``tokens`` with ``c`` of the ``L`` layers checkpointed keeps ``(L - c) x per_layer`` plus ``c`` layer
inputs (``h x dtype_bytes`` a token) plus, when ``c > 0``, one layer's activations rebuilt at a time in the backward.
The budget is the device's memory less ``headroom`` (10 %: allocator fragmentation, CUDA context, NCCL), less the
weights, gradients and AdamW's two states (``resident_bytes``; on several DDP ranks DDP's gradient buckets once more;
DeepSpeed ZeRO shards or offloads them), less a colocated vLLM engine's ``gpu_memory_utilization`` share while it
stays mapped (sleep level 0), or its copy of the weights alone at ``kv_cache`` (the KV cache is freed while the
learner trains: ``engine_weight_bytes``), less the loss's logits (3 fp32 copies of ``logit_chunk_rows`` x
vocabulary; every supervised row, bounded by the tokens, without chunking). ``auto`` takes the first that fits of:
off, selective every 4, 3, 2 layers, full (full also when nothing fits).

An engine asleep at level 1 or 2 is charged nothing: vLLM unmaps its whole pool while the learner trains, and
``InProcessVllm`` hands torch's cached free blocks back to the driver before each wake, so the pool maps back into
what the backward left cached. It was once charged its whole share, after wake failures on an H100 (2026-11-26, 2B,
engine at 0.3: with the share counted as 2 GiB, ``auto`` chose selective every 4th layer, which trained and then could
not map the KV cache back), which came before that cache release. Measured on an H100 with the release (2026-11-28,
sleep level 2, 16k-token rows, compiled layers without checkpointing; the driver's used memory, not torch's count,
which keeps counting the unmapped pool): Qwen3-VL-8B LoRA r64 beside an engine at 0.35 (26 GiB) used 68.1 GiB at
budget 0.6 (estimate: 47.0 activations + 18.9 resident + 1.7 loss = 67.6), 64.5 at 0.5 (60.5); 4B full beside 0.2
(15 GiB) 64.7 at 0.4 (60.6); the engine woke in every step of each run. The 2026-11-26 estimate against its measured
backward peaks (eager layers, less the memory held between steps): off 55.1 GiB estimated / 46.7 measured (one 16k
row), selective/4 43.8 / 34.6-42.9, selective/2 30.4 / 22.6-31.3 (the higher figure in each range: a step of two
rows).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from trainer.precision import compute_dtype

log = logging.getLogger(__name__)

POLICIES = ("full", "selective", "off", "auto")
#: ``selective`` without ``gradient_checkpointing_every_n_layers``: every other layer
DEFAULT_EVERY_N = 2
#: the selective spacings ``auto`` tries, fewest checkpointed layers first
AUTO_SPACINGS = (4, 3, 2)
HEADROOM = 0.10
#: packing off: prompt tokens assumed per target beside ``decoding.max_new_tokens`` (a 1024-visual-token image prompt)
PROMPT_TOKENS = 2048
GIB = 2**30


@dataclass(frozen=True)
class TextShape:
    """The language model's dimensions that size its activations."""

    layers: int
    hidden: int
    q_dim: int
    kv_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def from_config(cls, config: Any) -> TextShape:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        return cls(text.num_hidden_layers, text.hidden_size, text.num_attention_heads * head_dim, kv_heads * head_dim,
                   text.intermediate_size, text.vocab_size)


def activation_bytes_per_token_per_layer(shape: TextShape, dtype_bytes: int) -> int:
    """What one decoder layer keeps for its backward per token (module docstring)."""
    return dtype_bytes * (8 * shape.hidden + 8 * shape.q_dim + 7 * shape.kv_dim + 4 * shape.intermediate)


def compiled_activation_bytes_per_token_per_layer(shape: TextShape, dtype_bytes: int, budget: float = 1.0) -> float:
    """What one compiled decoder layer keeps for its backward per token under the partitioner's activation memory
    ``budget`` (module docstring)."""
    return dtype_bytes * (budget * 3 * (shape.hidden + shape.q_dim + shape.kv_dim + shape.intermediate) + shape.hidden)


def checkpointed_count(layers: int, policy: str, every_n: int | None = None) -> int:
    """Decoder layers a policy checkpoints (``selective``: every ``every_n``-th, rounded up)."""
    if policy == "full":
        return layers
    if policy == "off":
        return 0
    if policy == "selective":
        return math.ceil(layers / (every_n or DEFAULT_EVERY_N))
    raise ValueError(f"policy {policy!r}: resolve auto first; one of full, selective, off")


def activation_bytes(shape: TextShape, tokens: int, dtype_bytes: int, checkpointed: int,
                     compiled_budget: float | None = None) -> float:
    """Peak activation bytes of a forward + backward over ``tokens`` with ``checkpointed`` layers recomputed; eager
    layers, or compiled ones under the partitioner's ``compiled_budget``."""
    per_token = (activation_bytes_per_token_per_layer(shape, dtype_bytes) if compiled_budget is None
                 else compiled_activation_bytes_per_token_per_layer(shape, dtype_bytes, compiled_budget))
    per_layer = per_token * tokens
    inputs = checkpointed * shape.hidden * dtype_bytes * tokens
    return (shape.layers - checkpointed) * per_layer + inputs + (per_layer if checkpointed else 0)


@dataclass(frozen=True)
class MemoryPlan:
    """The inputs of ``auto`` (bytes): device size, what the step holds beside activations, the forward's tokens."""

    shape: TextShape
    tokens: int
    dtype_bytes: int
    device_bytes: float
    resident_bytes: float
    engine_bytes: float = 0.0
    loss_bytes: float = 0.0
    headroom: float = HEADROOM
    #: compiled decoder layers: the partitioner's activation memory budgets ``auto`` may run without checkpointing,
    #: largest first (one: the configured budget; ``AUTO_MEMORY_BUDGETS`` for ``auto``); checkpointed options run at the
    #: first. Empty: eager layers
    compiled_budgets: tuple[float, ...] = ()

    @property
    def budget_bytes(self) -> float:
        return self.device_bytes * (1 - self.headroom) - self.resident_bytes - self.engine_bytes - self.loss_bytes


@dataclass(frozen=True)
class CheckpointingChoice:
    """The policy that runs (``full`` | ``selective`` | ``off``) and, for ``auto``, the numbers behind it."""

    policy: str
    every_n_layers: int | None = None
    requested: str = ""
    estimates_gib: dict[str, float] = field(default_factory=dict)
    budget_gib: float | None = None
    reason: str = ""
    #: compiled layers: the partitioner's activation memory budget that runs (None: eager layers)
    memory_budget: float | None = None
    #: ``auto``: what the plan charges besides activations (weights, gradients, optimizer, DDP buckets, engine, loss)
    committed_gib: float | None = None

    @property
    def label(self) -> str:
        base = f"selective/{self.every_n_layers}" if self.policy == "selective" else self.policy
        return _with_budget(base, self.memory_budget)

    @property
    def estimated_peak_gib(self) -> float | None:
        """``auto``: the learner's estimated peak, the committed memory plus the activations of the policy that runs
        (compare with the step's measured ``mem/step_peak_gib``)."""
        if self.committed_gib is None or self.label not in self.estimates_gib:
            return None
        return self.committed_gib + self.estimates_gib[self.label]


def _with_budget(label: str, budget: float | None) -> str:
    return label if budget is None or budget == 1.0 or label == "full" else f"{label}@{budget:g}"


#: ``compile_activation_memory_budget: auto``: the budgets ``auto`` tries without checkpointing, largest first (0.3
#: already recomputes the MLP's up projection; below it the MLP's matmuls go, and checkpointing is the better trade).
#: At 8B LoRA on an H100, 16k rows: fwd + bwd 2.09 s at 0.6, 2.14 s at 0.5 (2026-11-28), 2.27 s at 0.3 (2026-11-27)
AUTO_MEMORY_BUDGETS = (1.0, 0.6, 0.5, 0.4, 0.3)


def choose_checkpointing(plan: MemoryPlan, spacings: tuple[int, ...] = AUTO_SPACINGS) -> CheckpointingChoice:
    """``auto``: the first of off (at each of ``plan.compiled_budgets``, largest first), selective every ``spacings``
    (fewest checkpointed first), full whose activation estimate fits ``plan.budget_bytes``; full when none does.
    Compiled layers are estimated with the compiled count, eager ones (no budgets) with the eager count."""
    L = plan.shape.layers
    budgets = plan.compiled_budgets or (None,)
    budget_of_rest = budgets[0]
    offs = [("off", None, b) for b in budgets]
    selective = sorted((("selective", k, budget_of_rest) for k in spacings), key=lambda o: math.ceil(L / o[1]))
    options = offs + selective + [("full", None, budget_of_rest)]
    estimates: dict[str, float] = {}
    for policy, k, b in options:
        label = _with_budget(f"selective/{k}" if k else policy, b)
        if label not in estimates:
            estimates[label] = activation_bytes(plan.shape, plan.tokens, plan.dtype_bytes,
                                                checkpointed_count(L, policy, k), b) / GIB
    budget = plan.budget_bytes / GIB
    committed = (plan.resident_bytes + plan.engine_bytes + plan.loss_bytes) / GIB
    off_label = _with_budget("off", offs[-1][2])
    for policy, k, b in options:
        label = _with_budget(f"selective/{k}" if k else policy, b)
        if estimates[label] <= budget:
            why = (f"activations ~{estimates[label]:.1f} GiB fit the {budget:.1f} GiB left ("
                   f"{plan.device_bytes / GIB:.1f} GiB x {1 - plan.headroom:.2f} - weights/grads/optimizer "
                   f"{plan.resident_bytes / GIB:.1f} - engine {plan.engine_bytes / GIB:.1f} - loss "
                   f"{plan.loss_bytes / GIB:.1f}) at {plan.tokens} tokens")
            if policy != "off":
                why += f"; {off_label} would need ~{estimates[off_label]:.1f} GiB"
            return CheckpointingChoice(policy, k, "auto", estimates, budget, why, b, committed)
    return CheckpointingChoice("full", None, "auto", estimates, budget,
                               f"nothing fits the {budget:.1f} GiB left (full needs ~{estimates['full']:.1f} GiB): "
                               "full, the least memory; lower training.packing_length if it runs out", budget_of_rest,
                               committed)


def _deepspeed_stage(deepspeed: str | None) -> tuple[int, bool]:
    """(ZeRO stage, offloaded) of a preset name (``zero2_offload``...); a JSON path counts as no sharding."""
    if deepspeed and deepspeed.startswith("zero") and deepspeed[4:5].isdigit():
        return int(deepspeed[4]), deepspeed.endswith("_offload")
    return 0, False


def resident_bytes(model: torch.nn.Module, deepspeed: str | None = None, world_size: int = 1) -> float:
    """Weights + gradients of the trained parameters + AdamW's two states (in the parameter dtype, as torch's AdamW
    keeps them). DDP (``world_size`` > 1 without ZeRO): one gradient copy more, DDP's flat all-reduce buckets. The
    trainer sets ``gradient_as_bucket_view``, but HF's ``zero_grad`` sets the gradients to None after each step, so
    the rows of a step accumulated under ``no_sync`` build fresh gradients beside the buckets (allocated once for every
    trained parameter) until the last row's all-reduce makes them views; the views save that copy from then on (the
    optimizer step, a one-row step's backward), not in the backward of a step of several rows. ZeRO: fp32 master +
    states (12 bytes a trained parameter) / world size from stage 1 (0 offloaded), gradients / world size from stage
    2, weights / world size at stage 3 (0 offloaded). ZeRO-2 on several ranks keeps, through the accumulation window,
    the whole gradient of every parameter that reaches into the rank's partition, so a parameter cut by an edge of the
    partition counts whole: the largest trained parameter's gradient once more for each edge (one on two ranks, two
    for a middle rank of more; the edges of the group without weight decay cut only norms and biases, left out; with
    the optimizer offloaded the gradients accumulate in host memory)."""
    params = list(model.parameters())
    weights = float(sum(p.numel() * p.element_size() for p in params))
    trained = [p for p in params if p.requires_grad]
    grads = float(sum(p.numel() * p.element_size() for p in trained))
    stage, offloaded = _deepspeed_stage(deepspeed)
    if stage == 0:
        buckets = grads if world_size > 1 else 0.0
        return weights + grads + buckets + 2 * grads
    states = 0.0 if offloaded else 12.0 * sum(p.numel() for p in trained) / world_size
    if stage >= 2:
        grads /= world_size
    if stage == 2 and world_size > 1 and not offloaded:
        largest = max((p.numel() * p.element_size() for p in trained), default=0)
        grads += (1 if world_size == 2 else 2) * largest
    if stage == 3:
        weights = 0.0 if offloaded else weights / world_size
    return weights + grads + states


def engine_weight_bytes(model: torch.nn.Module, dtype: str, tensor_parallel_size: int = 1) -> float:
    """What a colocated engine's copy of the weights takes on one GPU: every parameter but peft's adapter factors
    (``lora_*``), in the engine's ``vllm.dtype`` (``auto``: 2 bytes, the half precision vLLM serves a float32 or
    bfloat16 checkpoint in), split over its tensor-parallel ranks."""
    width = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 2}[dtype]
    count = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
    return float(count * width) / max(1, tensor_parallel_size)


def device_bytes() -> float:
    """The training device's memory: the current CUDA device's, else the host's physical memory."""
    if torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def forward_tokens(cfg) -> int:
    """Tokens of one forward: ``packing_length`` (packing), else ``per_device_train_batch_size`` x
    (``vllm.max_model_len`` or ``decoding.max_new_tokens`` + ``PROMPT_TOKENS``)."""
    t = cfg.training
    if t.packing and t.packing_length:
        return t.packing_length
    rm = cfg.custom.extra.rollout_matching
    if rm is None:
        return t.per_device_train_batch_size * PROMPT_TOKENS
    per_target = (rm.vllm.max_model_len if rm.rollout_backend == "vllm" and rm.vllm.max_model_len
                  else rm.decoding.max_new_tokens + PROMPT_TOKENS)
    return t.per_device_train_batch_size * per_target


def memory_plan(cfg, model: torch.nn.Module, world_size: int = 1, device: float | None = None) -> MemoryPlan:
    """``MemoryPlan`` of a validated config and its (tuned) model; ``device``: bytes (default ``device_bytes()``)."""
    t = cfg.training
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    shape = TextShape.from_config(base.config)
    dtype = compute_dtype(model)
    dtype_bytes = 2 if (t.bf16 or dtype in (torch.bfloat16, torch.float16)) else 4
    tokens = forward_tokens(cfg)
    total = device_bytes() if device is None else device
    rm = cfg.custom.extra.rollout_matching
    engine = 0.0
    if rm is not None and rm.rollout_backend == "vllm" and rm.vllm.mode == "colocate":
        if rm.vllm.sleep_level == 0:
            engine = rm.vllm.gpu_memory_utilization * total
        elif rm.vllm.sleep_level == "kv_cache":
            engine = engine_weight_bytes(model, rm.vllm.dtype, rm.vllm.tensor_parallel_size)
    chunk = rm.loss.logit_chunk_rows if rm is not None and rm.loss.supervised_logits_only else None
    loss = 3 * 4 * min(chunk or tokens, tokens) * shape.vocab
    requested = t.compile_activation_memory_budget
    budgets = () if not t.compile_decoder_layers else (
        AUTO_MEMORY_BUDGETS if requested == "auto" else (float(requested),))
    return MemoryPlan(shape, tokens, dtype_bytes, total, resident_bytes(model, t.deepspeed, world_size), engine,
                      float(loss), compiled_budgets=budgets)


def resolve_checkpointing(cfg, model: torch.nn.Module, world_size: int = 1,
                          device: float | None = None) -> CheckpointingChoice:
    """The policy that runs: the configured one, or ``auto``'s choice (``choose_checkpointing``)."""
    t = cfg.training
    policy = t.checkpointing_policy
    if policy == "auto":
        spacings = (t.gradient_checkpointing_every_n_layers,) if t.gradient_checkpointing_every_n_layers else \
            AUTO_SPACINGS
        return choose_checkpointing(memory_plan(cfg, model, world_size, device), spacings)
    every = (t.gradient_checkpointing_every_n_layers or DEFAULT_EVERY_N) if policy == "selective" else None
    budget = float(t.compile_activation_memory_budget) if t.compile_decoder_layers else None
    return CheckpointingChoice(policy, every, policy, memory_budget=budget)


def resolved_config(cfg, choice: CheckpointingChoice):
    """A copy of ``cfg`` whose training section names the policy that runs (``auto`` resolved), for
    ``trainer.sft.run.training_arguments``; ``gradient_checkpointing`` is true only for full."""
    update = {"gradient_checkpointing_policy": choice.policy,
              "gradient_checkpointing_every_n_layers": choice.every_n_layers,
              "gradient_checkpointing": choice.policy == "full"}
    if choice.memory_budget is not None:
        update["compile_activation_memory_budget"] = choice.memory_budget
    t = cfg.training.model_copy(update=update)
    return cfg.model_copy(update={"training": t})


def training_arguments_kwargs(t, fields: dict[str, Any]) -> dict[str, Any]:
    """``TrainingArguments`` keywords of ``t``'s (resolved) policy; ``fields``: ``TrainingArguments``'s dataclass
    fields (transformers 5.2x renames ``gradient_checkpointing`` to ``activation_checkpointing``)."""
    prefix = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    policy = t.checkpointing_policy
    if policy == "auto":
        raise ValueError("training.gradient_checkpointing_policy: auto is resolved at start-up "
                         "(trainer.modeling.checkpointing.resolve_checkpointing) before the training arguments")
    if policy == "selective":
        every = t.gradient_checkpointing_every_n_layers or DEFAULT_EVERY_N
        return {prefix: True, f"{prefix}_kwargs": {"use_reentrant": False, "every_n_layers": every}}
    return {prefix: policy == "full"}


def checkpointed_decoder_layers(model: torch.nn.Module, policy: str, every_n: int | None = None) -> list[int]:
    """Indices of the language model's decoder layers that ``policy`` checkpoints, counted as HF's
    ``_set_gradient_checkpointing(every_n_layers=...)`` counts: every ``GradientCheckpointingLayer`` of the model in
    module order (vision blocks too), index % n == 0."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    from trainer.modeling.compile import decoder_layers

    layers = list(decoder_layers(model))
    if policy == "off":
        return []
    if policy == "full":
        return list(range(len(layers)))
    every = every_n or DEFAULT_EVERY_N
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    counted = [m for m in base.modules() if isinstance(m, GradientCheckpointingLayer)]
    chosen = {id(m) for i, m in enumerate(counted) if i % every == 0}
    return [i for i, layer in enumerate(layers) if id(layer) in chosen]
