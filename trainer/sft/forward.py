"""One teacher-forced forward and the stage-2 loss, shared by the trainer and the benchmarks."""

from __future__ import annotations

from typing import Any

import torch

from trainer.losses.chunked_objective import chunked_objective
from trainer.losses.objective import LossTerms, LossWeights, objective_from_rows
from trainer.losses.supervised_logits import capture_lm_head_input, output_embedding, rows_from_logits, supervised_rows
from trainer.sft.mismatch import MISMATCH_KEYS, MismatchStats, learner_logprobs

LOSS_KEYS = ("ce_index", "ce_labels", "ce_segment", "coord_index", "coord_targets", "coord_segment", "num_segments",
             "sample_ids", "rollout_steps", "decode_steps", "packed_cu_seq_lens", "packed_max_length",
             "loss_ce_denominator", "loss_coord_denominator", "loss_weight", "image_positions", *MISMATCH_KEYS)


def forward_loss(model: torch.nn.Module, inputs: dict[str, Any], coord_ids: torch.Tensor, weights: LossWeights,
                 supervised_logits: bool = True, unwrapped: torch.nn.Module | None = None,
                 logit_chunk_rows: int | None = None, mismatch: MismatchStats | None = None,
                 temperature: float = 0.0) -> tuple[torch.Tensor, LossTerms, Any]:
    """Loss, detached terms (``LossTerms``: left on the device, nothing here waits for it) and the model outputs for a
    padded or packed batch.

    ``model`` may be a wrapper (DDP, DeepSpeed); ``unwrapped`` is the module that owns the LM head (default:
    ``model``). With ``supervised_logits`` the returned outputs carry zero-length logits, and ``logit_chunk_rows``
    projects and reduces the supervised rows that many at a time (``trainer.losses.chunked_objective``). The loss is
    multiplied by the batch's ``loss_weight`` (the terms are not): the data-parallel world size for a row of a step
    whose denominators count every rank's tokens, so the ranks' averaged gradients are the step's token mean; 0 for a
    rank's filler micro-batch (so every data-parallel rank makes the same number of backward passes), which returns
    a zero loss that still reaches every parameter the forward used.

    With ``mismatch``, the learner's log-probabilities of the batch's kept rollout tokens (``logp_index``, at the
    decoding ``temperature``, without autograd, ``logit_chunk_rows`` tokens at a time as the loss's rows) are compared
    with the engine's (``logp_engine``) and added to it (``trainer.sft.mismatch``; a zero-weight filler adds nothing).
    """
    measure = (mismatch is not None and "logp_index" in inputs and inputs["logp_index"].numel() > 0
               and float(inputs.get("loss_weight", 1.0)) != 0.0)
    loss, terms, outputs = _forward_loss(model, inputs, coord_ids, weights, supervised_logits, unwrapped,
                                         logit_chunk_rows, measure and (mismatch, temperature))
    if "loss_weight" in inputs:
        loss = loss * float(inputs["loss_weight"])
        if not float(inputs["loss_weight"]):
            terms = {k: 0.0 for k in terms}
    return loss, terms, outputs


def _forward_loss(model: torch.nn.Module, inputs: dict[str, Any], coord_ids: torch.Tensor, weights: LossWeights,
                  supervised_logits: bool, unwrapped: torch.nn.Module | None,
                  logit_chunk_rows: int | None, measure: Any = False) -> tuple[torch.Tensor, LossTerms, Any]:
    model_inputs = {k: v for k, v in inputs.items() if k not in LOSS_KEYS}
    if supervised_logits:
        owner = model if unwrapped is None else unwrapped
        with capture_lm_head_input(owner) as captured:
            outputs = model(**model_inputs, use_cache=False)
        if measure:
            learner = learner_logprobs(captured.hidden.detach(), output_embedding(owner), inputs["input_ids"],
                                       inputs["logp_index"], measure[1], logit_chunk_rows)
            measure[0].add(MismatchStats.of(learner, inputs["logp_engine"]))
        if logit_chunk_rows:
            loss, terms = chunked_objective(captured.hidden, output_embedding(owner), inputs, coord_ids, weights,
                                            logit_chunk_rows, coord_only=weights.coord_gate == 0)
            return loss, terms, outputs
        rows = supervised_rows(captured.hidden, output_embedding(owner), inputs, coord_ids,
                               coord_only=weights.coord_gate == 0)
    else:
        outputs = model(**model_inputs, use_cache=False)
        if measure:
            learner = learner_logprobs(outputs.logits.detach(), None, inputs["input_ids"], inputs["logp_index"],
                                       measure[1], logit_chunk_rows)
            measure[0].add(MismatchStats.of(learner, inputs["logp_engine"]))
        rows = rows_from_logits(outputs.logits, inputs)
    loss, terms = objective_from_rows(rows, inputs, coord_ids, weights)
    return loss, terms, outputs
