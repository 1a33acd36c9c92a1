"""vLLM worker extension (``worker_extension_cls``) for weight updates; runs inside every vLLM worker.

Full weights are reloaded with vLLM's own in-place reload path (``Worker.reload_weights`` / layerwise
reload), which restores checkpoint layout, loads, and re-runs the kernel post-processing (CPU weight
repacking included); calling ``model.load_weights`` on a live engine skips that and breaks repacked layers.

Two sources of weights:
- a safetensors file on the local filesystem (``rm_reload_from_file``): colocate sync and our server's
  in-band HTTP transport, on CPU and GPU alike;
- an NCCL group with the learner (``rm_init_communicator`` + ``rm_receive_*``), joined through vLLM's
  ``StatelessProcessGroup`` + ``PyNcclCommunicator`` as ms-swift's ``swift rollout`` does (or, when the learner
  asks for the torch backend, our ``StoreGroup`` + ``TorchStatelessCommunicator``); buckets received
  between ``rm_begin_update`` and ``rm_finish_update`` form one reload.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from trainer.sync.buckets import FlatTensorMeta, torch_dtype, unflatten
from trainer.sync.weights import AdapterWeights, write_adapter_dir


class WeightSyncWorkerExtension:
    """Mixed into vLLM's worker class; every method is called through ``LLM.collective_rpc``."""

    rm_communicator: Any = None
    rm_client_rank: int | None = None
    rm_update_open: bool = False

    def _rm_model(self) -> torch.nn.Module:
        return self.model_runner.get_model()

    def _rm_reset_derived_state(self) -> None:
        runner = self.model_runner
        for name in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            fn = getattr(runner, name, None)
            if fn is not None:
                fn()

    def rm_state_keys(self) -> list[str]:
        return [name for name, _ in self._rm_model().named_parameters()]

    def rm_reload_from_file(self, path: str) -> int:
        """Reload every weight in the safetensors file at ``path`` (HF checkpoint names); returns the count."""
        from safetensors.torch import load_file

        tensors = load_file(path, device=str(self.device) if str(self.device) != "cpu" else "cpu")
        self.reload_weights(weights_iterator=list(tensors.items()), is_checkpoint_format=True)
        return len(tensors)

    def rm_begin_update(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        if not self.rm_update_open:
            initialize_layerwise_reload(self._rm_model())
            self.rm_update_open = True

    def rm_load_tensors(self, tensors: dict[str, torch.Tensor]) -> int:
        self.rm_begin_update()
        self._rm_model().load_weights(weights=list(tensors.items()))
        return len(tensors)

    def rm_finish_update(self) -> bool:
        """Finalise an open update (kernel post-processing on complete weights); False when none was open."""
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        if not self.rm_update_open:
            return False
        finalize_layerwise_reload(self._rm_model(), self.model_runner.model_config)
        self.rm_update_open = False
        self._rm_reset_derived_state()
        return True

    def rm_init_communicator(self, host: str, port: int, world_size: int, backend: str = "pynccl") -> None:
        """Join the learner's weight-update group; the learner is the last rank (``world_size - 1``). ``backend``:
        ``pynccl`` (ms-swift's: ``StatelessProcessGroup`` + ``PyNcclCommunicator``) or ``torch-nccl`` /
        ``torch-gloo`` (``StoreGroup`` + ``TorchStatelessCommunicator``, see ``trainer.sync.transports``)."""
        from vllm.distributed.parallel_state import get_world_group

        from trainer.sync.transports import TorchStatelessCommunicator, make_group

        if self.rm_communicator is not None:
            return
        parallel = self.vllm_config.parallel_config
        rank = get_world_group().rank + int(getattr(parallel, "data_parallel_index", 0) or 0) * parallel.tensor_parallel_size
        group = make_group("pynccl" if backend == "pynccl" else "torch", host, port, rank, world_size)
        if backend == "pynccl":
            from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator

            self.rm_communicator = PyNcclCommunicator(group, device=self.device)
        else:
            device = self.device if backend == "torch-nccl" else torch.device("cpu")
            self.rm_communicator = TorchStatelessCommunicator(group, device)
        self.rm_client_rank = world_size - 1

    def _rm_receive(self, nbytes_or_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.rm_communicator is None:
            raise RuntimeError("weight-update communicator not initialised: call /init_communicator/ first")
        buf = torch.empty(nbytes_or_shape, dtype=dtype, device=self.rm_communicator.device)
        cuda = buf.is_cuda
        self.rm_communicator.broadcast(buf, src=self.rm_client_rank, stream=torch.cuda.current_stream() if cuda else None)
        if cuda:
            torch.cuda.synchronize()
        self.rm_communicator.group.barrier()
        return buf if buf.device == self.device else buf.to(self.device)

    def rm_receive_named(self, name: str, dtype: str, shape: list[int]) -> int:
        tensor = self._rm_receive(tuple(shape), torch_dtype(dtype))
        return self.rm_load_tensors({name: tensor})

    def rm_receive_flattened(self, metadatas: list[dict[str, Any]]) -> int:
        metas = [FlatTensorMeta.model_validate(m) for m in metadatas]
        bucket = self._rm_receive((metas[-1].end_idx,), torch.uint8)
        return self.rm_load_tensors(unflatten(metas, bucket))

    def rm_receive_adapter_flattened(self, peft_config: dict[str, Any], metadatas: list[dict[str, Any]],
                                     adapter_dir: str) -> str:
        """Receive a LoRA bucket and write it as an adapter directory (by the first worker only)."""
        from vllm.distributed.parallel_state import get_world_group

        metas = [FlatTensorMeta.model_validate(m) for m in metadatas]
        bucket = self._rm_receive((metas[-1].end_idx,), torch.uint8)
        if get_world_group().rank == 0:
            tensors = {k: v.to("cpu") for k, v in unflatten(metas, bucket).items()}
            write_adapter_dir(Path(adapter_dir), AdapterWeights(peft_config, tensors))
        return adapter_dir

    def rm_close_communicator(self) -> None:
        self.rm_communicator = None
        self.rm_client_rank = None
