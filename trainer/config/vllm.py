"""Config section ``custom.extra.rollout_matching.vllm``: colocate engine knobs, server list, weight sync."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from trainer.config.base import Section


class VllmServerEntry(Section):
    base_url: str
    api_key_env: str | None = None


class AsyncRolloutsConfig(Section):
    """``async_rollouts`` (stage-2 server mode): while the learner trains optimizer step i, the servers already decode
    the whole batch of step i+1 (a background request; weight pushes wait for it). ``max_staleness_steps``: the most
    optimizer steps a sample's decode weights may lag the step that trains on it (1 = one step off-policy; 0 = no
    decode ahead: a step's records are decoded together on its own weights). See docs/concepts/stage2.md."""

    enabled: bool = False
    max_staleness_steps: int = Field(1, ge=0)


class VllmServerConfig(Section):
    """``servers`` (preferred) or the strict legacy paired lists ``host`` + ``port`` (same length).

    Faults: a chunk that fails (down, stalled past ``infer_timeout_s``, bad answer) is retried on the other
    servers up to ``max_retries`` rounds and the server is quarantined (no rollouts, no weight pushes; NCCL:
    dropped from the group). ``readmit_after_s``: seconds after the failure before a quarantined server is probed
    on ``/health/`` (at the next weight sync); a failed probe doubles the wait up to ``readmit_max_interval_s``;
    a server that answers gets the full current weights pushed to it alone and serves again only once that
    succeeded. ``null`` keeps failed servers quarantined for the rest of the run.
    """

    servers: list[VllmServerEntry] = Field(default_factory=list)
    host: list[str] | None = None
    port: list[int] | None = None
    timeout_s: float = Field(240.0, gt=0)
    infer_timeout_s: float | None = Field(None, gt=0)
    max_retries: int = Field(1, ge=0)
    readmit_after_s: float | None = Field(30.0, gt=0)
    readmit_max_interval_s: float = Field(300.0, gt=0)
    async_rollouts: AsyncRolloutsConfig = Field(default_factory=AsyncRolloutsConfig)

    @model_validator(mode="after")
    def _one_form(self) -> VllmServerConfig:
        legacy = self.host is not None or self.port is not None
        if legacy and self.servers:
            raise ValueError("use either server.servers or the legacy server.host/server.port lists, not both")
        if legacy:
            if self.host is None or self.port is None or len(self.host) != len(self.port) or not self.host:
                raise ValueError("legacy server.host and server.port must be non-empty lists of the same length")
        return self

    def base_urls(self) -> list[str]:
        if self.servers:
            return [s.base_url.rstrip("/") for s in self.servers]
        return [f"http://{h}:{p}" for h, p in zip(self.host or [], self.port or [])]


class VllmSyncConfig(Section):
    """``mode``: full (merged weights) | adapter (LoRA only) | auto. ``transport`` (server mode): nccl (GPU,
    what swift rollout expects) | inband (our HTTP transport, any device) | auto (nccl on CUDA, else inband).
    ``nccl_backend`` (nccl transport): pynccl (vLLM's PyNcclCommunicator, what swift rollout speaks; needs vLLM
    on the learner) | torch (a ProcessGroupNCCL built without the default process group; no vLLM needed; our
    servers only) | auto (pynccl when vLLM is importable on the learner, else torch). ``allow_dtype_cast``: let the
    colocated engine take weights of another floating dtype than it serves (``vllm.dtype``) and cast them; off, a
    learner/engine dtype mismatch is a config error at start-up (rollout servers decide this with
    ``serve --allow-dtype-cast``). ``shm_dir`` (inband only): a directory the learner and every rollout server see
    (one host: a tmpfs such as /dev/shm); the update is written there once and each server, started with the same
    ``serve --shm-dir``, reads it instead of receiving it over HTTP. ``resend_frozen`` (server mode, full sync):
    false (default) sends the weights training cannot change (frozen vision tower, norms, a LoRA model's
    un-adapted weights) to a server only at its first sync and at every re-admission, then only the changing ones;
    true sends every weight at every sync. ``merge_precision`` (full sync of a LoRA learner): weight_dtype (default)
    rounds the LoRA factors to the weights' dtype and merges each layer with one GEMM that accumulates onto the
    weight in float32 and rounds once (each 16-bit weight read and written once; the training forward uses the
    factors at that precision under bf16 autocast too); float32 computes ``B @ A`` in float32 as peft's merge does
    (bit-equal to peft up to summation order; each weight copied into float32 and back: ~6x the bytes moved). The
    two differ by one rounding step of the merged weight in a few percent of elements (docs/concepts/weight-sync.md)."""

    mode: Literal["full", "adapter", "auto"] = Field(
        "auto", description="full: merged weights; adapter: the LoRA adapter alone (the engine serves it with vLLM's "
        "LoRA); auto (default): the adapter for a LoRA learner whose engines serve adapters, merged weights "
        "otherwise. A merge into 16-bit engine weights rounds away the part of an early, small update below half "
        "a bf16 step (logged as sync/merge_lost_fraction, with a warning above 10%)")
    fallback_to_full: bool = True
    transport: Literal["auto", "nccl", "inband"] = "auto"
    nccl_backend: Literal["auto", "pynccl", "torch"] = "auto"
    group_port: int = Field(51216, ge=1024, le=65535)
    bucket_mb: int = Field(512, ge=1)
    broadcast_timeout_s: float = Field(
        120.0, gt=0, description="nccl transport: one bucket's broadcast to one server must complete within this; a "
        "server killed or stalled mid-broadcast then fails that push (communicator aborted, server quarantined, "
        "re-admitted with the current weights when it answers) instead of hanging the learner")
    allow_dtype_cast: bool = False
    prewake: bool = Field(
        False, description="colocate, sleep mode: start waking the engine's weights on a thread when a sync begins, "
        "so that vLLM's per-allocation remapping overlaps the learner's finite check and LoRA merge; false (the "
        "default) wakes them after the merge, one after the other. Measured at 8B LoRA on an H100 (2026-11-26): the "
        "wake thread slowed the learner's check by about as much as it overlapped, sync 0.44 s on vs 0.31 s off")
    recorded_load: bool = Field(
        False, description="colocate: record vLLM's weight loader once (each copy from the update into a parameter "
        "view) and replay the copies, grouped per dtype, for every later update with the same names, shapes and "
        "dtypes, instead of vLLM's per-tensor Python loaders (0.05-0.08 s per sync at 8B on an H100). A loader that "
        "does more than copy is detected and keeps running (logged once; vLLM's CPU build, whose loads repack the "
        "weights, always does). Off by default; on an H200 (8B LoRA) the load took 0.023 s against 0.037 s")
    overlap_wake: bool = Field(
        False, description="colocate, sleep mode: queue the LoRA merge and the update's finite check on the GPU, wake "
        "the engine's weights on the calling thread while they run (vLLM's wake is host work: one driver mapping per "
        "allocation), then read the check before any weight is written (a refused update changes no served weight); "
        "false (the default) runs merge, check and wake one after the other. Not with prewake (a wake on a thread). "
        "Measured at 8B LoRA on an H100 (2026-11-28): sync 0.168 / 0.184 s on against 0.168 / 0.154 s off, the "
        "wake's release of torch's cached blocks waiting for the queued work")
    merge_into_engine: bool = Field(
        False, description="colocate, sleep_level 2, with recorded_load (a LoRA learner's full sync): each LoRA "
        "layer's merge GEMM (weight + B @ A, as merge_precision weight_dtype rounds it) writes straight into the "
        "woken engine's parameter, instead of into a merged copy of the model that the load then copies in; every "
        "written parameter is checked finite afterwards (a refused update leaves the engine without valid weights, "
        "as its level-2 sleep already did). The first sync, which records the load, and any update the recording "
        "does not fit merge on the learner's side as before")
    shm_dir: str | None = None
    resend_frozen: bool = False
    merge_precision: Literal["weight_dtype", "float32"] = "weight_dtype"

    @model_validator(mode="after")
    def _backend_needs_nccl(self) -> VllmSyncConfig:
        if self.transport == "inband" and self.nccl_backend != "auto":
            raise ValueError(f"sync.nccl_backend: {self.nccl_backend} only applies to sync.transport nccl (or auto); "
                             "the inband transport has no communicator — drop nccl_backend or set transport: nccl")
        if self.overlap_wake and self.prewake:
            raise ValueError("sync.overlap_wake and sync.prewake both wake the weights during the sync (on this thread "
                             "behind the GPU's merge and check, or on a thread of their own); set one of them")
        if self.merge_into_engine and not self.recorded_load:
            raise ValueError("sync.merge_into_engine writes through the recorded load's copies; set sync.recorded_load: "
                             "true too, or drop merge_into_engine")
        if self.merge_into_engine and self.overlap_wake:
            raise ValueError("sync.merge_into_engine checks the weights after writing them and sync.overlap_wake checks "
                             "them while the weights wake, before writing; set one of them")
        if self.shm_dir is not None and self.transport != "inband":
            raise ValueError(f"sync.shm_dir: {self.shm_dir} only applies to sync.transport inband (it stages the "
                             "in-band payload in a shared directory); set transport: inband or drop shm_dir")
        return self


class VllmConfig(Section):
    mode: Literal["colocate", "server"] = "colocate"
    tensor_parallel_size: int = Field(1, ge=1)
    gpu_memory_utilization: float = Field(0.45, gt=0.0, le=1.0)
    max_model_len: int | None = Field(None, ge=16)
    enable_lora: bool | None = Field(
        None, description="colocate: start the engine with vLLM's LoRA so a LoRA learner's adapter is served as it "
        "is trained. null (default): on for a LoRA learner whose adapter leaves the vision tower alone, off otherwise; "
        "false: merged weights at every sync (faster decodes, but a 16-bit engine loses the small early updates: "
        "sync/merge_lost_fraction)")
    enable_prefix_caching: bool = True
    sleep_level: Literal[0, 1, 2, "kv_cache"] = Field(
        0, description="colocate: what the engine gives back between decodes. 0: nothing; 1: vLLM offloads the "
        "weights to CPU memory and drops the KV cache; 2: vLLM drops both (the next sync maps the weights back and "
        "loads the learner's); kv_cache: the KV cache alone, the weights stay on the GPU through the training "
        "(the sync loads into them, nothing is mapped back for it; the learner has that much less memory)")
    enforce_eager: bool = False
    disable_custom_all_reduce: bool = Field(
        False, description="colocate TP groups: all-reduce through NCCL only (vLLM's disable_custom_all_reduce), "
        "for nodes where vLLM's custom all-reduce kernels fail; its symmetric-memory all-reduce is switched off "
        "on its own where NVLink multicast is (TORCH_SYMM_MEM_DISABLE_MULTICAST=1)")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    pixels_during_decode: bool = Field(
        False, description="the image processor makes the step's training pixels on a thread while the rollouts "
        "decode (the prompt ids only need each image's size), instead of before the decode on the step's path; "
        "colocate, or rollout servers with server.async_rollouts off (the servers read the image files)")
    server: VllmServerConfig = Field(default_factory=VllmServerConfig)
    sync: VllmSyncConfig = Field(default_factory=VllmSyncConfig)

    @model_validator(mode="after")
    def _merge_into_engine_needs_level_2(self) -> VllmConfig:
        if self.sync.merge_into_engine and (self.mode != "colocate" or self.sleep_level != 2):
            raise ValueError(f"sync.merge_into_engine writes into a colocated engine that holds no valid weights: it "
                             f"needs mode: colocate and sleep_level: 2 (got mode: {self.mode}, sleep_level: "
                             f"{self.sleep_level}); drop merge_into_engine or set those")
        return self

    @model_validator(mode="after")
    def _pixels_during_decode_is_on_the_step(self) -> VllmConfig:
        if self.pixels_during_decode and self.mode == "server" and self.server.async_rollouts.enabled:
            raise ValueError("pixels_during_decode and server.async_rollouts.enabled do not combine: async rollouts "
                             "already make the next batch's requests and pixels in the background while this one "
                             "trains; set pixels_during_decode: false")
        return self
