"""HF ``generate`` rollout backend: microbatched (padded, left padding), no grad, stop-trimmed."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trainer.rollout.types import DecodingParams, RolloutRequest, RolloutResult


class HFRolloutEngine:
    """Decodes with the training model itself (``rollout_backend: hf``).

    ``generate`` runs ``ceil(N / batch_size)`` padded ``model.generate`` calls; each result's response ends at
    (and includes) the first stop id, or is cut at ``max_new_tokens`` (``finish_reason='length'``).
    """

    name = "hf"

    def __init__(self, model: torch.nn.Module, pad_id: int, stop_ids: Sequence[int], batch_size: int = 1,
                 image_token_id: int | None = None):
        if batch_size < 1:
            raise ValueError("rollout_generate_batch_size must be >= 1")
        self.model = model
        self.pad_id = pad_id
        self.stop_ids = frozenset(stop_ids)
        self.batch_size = batch_size
        self.image_token_id = image_token_id

    def _batch_inputs(self, requests: Sequence[RolloutRequest], device: torch.device) -> dict[str, torch.Tensor]:
        width = max(len(r.prompt_token_ids) for r in requests)
        ids = torch.full((len(requests), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(requests), width), dtype=torch.long)
        for i, r in enumerate(requests):
            n = len(r.prompt_token_ids)
            ids[i, width - n:] = torch.tensor(r.prompt_token_ids, dtype=torch.long)
            mask[i, width - n:] = 1
        batch: dict[str, torch.Tensor] = {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
        if any(r.mm_inputs for r in requests):
            batch["pixel_values"] = torch.cat([r.mm_inputs["pixel_values"] for r in requests if r.mm_inputs]).to(device)
            batch["image_grid_thw"] = torch.cat([r.mm_inputs["image_grid_thw"] for r in requests if r.mm_inputs]).to(device)
            if self.image_token_id is not None:
                batch["mm_token_type_ids"] = (batch["input_ids"] == self.image_token_id).long() * batch["attention_mask"]
        return batch

    def _generate_batch(self, requests: Sequence[RolloutRequest], params: DecodingParams) -> list[RolloutResult]:
        device = next(self.model.parameters()).device
        batch = self._batch_inputs(requests, device)
        kwargs = dict(max_new_tokens=params.max_new_tokens, pad_token_id=self.pad_id,
                      eos_token_id=sorted(self.stop_ids), repetition_penalty=params.repetition_penalty)
        if params.greedy:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            kwargs.update(do_sample=True, temperature=params.temperature, top_p=params.top_p,
                          top_k=params.top_k if params.top_k > 0 else None)
        out = self.model.generate(**batch, **kwargs)
        width = batch["input_ids"].shape[1]
        results = []
        for i, r in enumerate(requests):
            prompt = batch["input_ids"][i][batch["attention_mask"][i].bool()].tolist()
            response: list[int] = []
            finish = "length"
            for t in out[i, width:].tolist():
                response.append(t)
                if t in self.stop_ids:
                    finish = "stop"
                    break
            results.append(RolloutResult(r.sample_id, tuple(prompt), tuple(response), finish))
        return results

    @torch.no_grad()
    def generate(self, requests: Sequence[RolloutRequest], params: DecodingParams) -> list[RolloutResult]:
        if not requests:
            return []
        was_training = self.model.training
        self.model.eval()
        generator_state = None
        if params.seed is not None and not params.greedy:
            generator_state = torch.random.get_rng_state()
            torch.manual_seed(params.seed)
        try:
            results: list[RolloutResult] = []
            for start in range(0, len(requests), self.batch_size):
                results.extend(self._generate_batch(requests[start:start + self.batch_size], params))
            return results
        finally:
            if generator_state is not None:
                torch.random.set_rng_state(generator_state)
            self.model.train(was_training)

    def close(self) -> None:
        return None
