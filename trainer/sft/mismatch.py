"""Train-inference mismatch: does the rollout engine decode with the learner's policy?

Every stage-2 step compares, at each rollout token the target keeps (the rollout prefix, up to the first token the
parser re-encoded), the log-probability the engine sampled it with and the learner's, from the teacher-forced forward
the step already runs. With ``d = log p_learner - log p_engine`` per token:

- ``mismatch/logp_abs_diff_mean`` and ``mismatch/logp_abs_diff_max``: mean and max of ``|d|`` (nats);
- ``mismatch/kl_k3``: the k3 estimate of KL(engine || learner), the mean of ``exp(d) - 1 - d`` (>= 0; tokens were
  drawn from the engine);
- ``mismatch/tokens``: the tokens compared.

Both sides are the distribution the token was sampled from: the learner's logits divided by the decoding
temperature when sampling, the raw logits when greedy (top-k, top-p and the repetition penalty are not applied to the
learner's side). A stale engine, a weight sync that lost the update or an adapter that never arrived shows here; a
healthy bf16 engine stays within a few hundredths of a nat.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

#: the batch keys ``loss_indices`` adds for the mismatch: ``(row, col)`` of each kept rollout token, and the engine's
#: log-probability of the token there
MISMATCH_KEYS = ("logp_index", "logp_engine")


#: ``rollout_matching.mismatch.warn_mean_abs_diff``'s default (nats a kept rollout token)
DEFAULT_MISMATCH_WARN = 0.05


def kept_engine_logprobs(prompt_len: int, response_ids: Sequence[int], prefix_ids: Sequence[int],
                         logprobs: Sequence[dict[int, float]] | None) -> list[tuple[int, float]]:
    """``(position in prompt + response, engine log-probability)`` of each rollout token the target keeps: the
    target's prefix tokens that equal the response's, up to the first that differs (the parser keeps the response's
    tokens verbatim up to the junction). Empty without log-probabilities."""
    if logprobs is None:
        return []
    out = []
    for i, (kept, sampled) in enumerate(zip(prefix_ids, response_ids)):
        if kept != sampled or i >= len(logprobs) or sampled not in logprobs[i]:
            break
        out.append((prompt_len + i, float(logprobs[i][sampled])))
    return out


@torch.no_grad()
def learner_logprobs(hidden: torch.Tensor, head: torch.nn.Module | None, input_ids: torch.Tensor,
                     index: torch.Tensor, temperature: float, chunk_rows: int | None = None) -> torch.Tensor:
    """The learner's log-probability of the token at each ``(row, col)`` of ``index``: from the final hidden states
    ``[B, T, H]`` projected by ``head`` at ``(row, col - 1)``, or, with ``head`` None, from ``hidden`` as logits
    ``[B, T, V]``. ``temperature`` > 0 divides the logits (the sampling distribution); 0 leaves them raw.

    ``chunk_rows`` (``loss.logit_chunk_rows``) projects and log-softmaxes that many tokens at a time, so at most
    ``chunk_rows`` x vocabulary logits are alive at once; None: every token at once. Runs without autograd: the
    result is a detached float32 ``[N]`` and adds nothing to the graph."""
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    index = index.to(hidden.device)
    ids = input_ids.to(hidden.device)
    step = chunk_rows or max(int(index.shape[0]), 1)
    parts = []
    for start in range(0, index.shape[0], step):
        at = index[start:start + step]
        rows = hidden[at[:, 0], at[:, 1] - 1]
        logits = (head(rows) if head is not None else rows).float()
        if temperature > 0:
            logits = logits / temperature
        tokens = ids[at[:, 0], at[:, 1]]
        parts.append(torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None])[:, 0])
        del rows, logits
    return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)


@dataclass
class MismatchStats:
    """Sums over compared tokens (kept as tensors: nothing here waits for the device until ``summary``)."""

    abs_sum: torch.Tensor | float = 0.0
    abs_max: torch.Tensor | float = 0.0
    k3_sum: torch.Tensor | float = 0.0
    tokens: int = 0

    @staticmethod
    def of(learner: torch.Tensor, engine: torch.Tensor) -> MismatchStats:
        d = learner.float() - engine.to(learner.device).float()
        if not d.numel():
            return MismatchStats()
        a = d.abs()
        return MismatchStats(a.sum(), a.max(), (torch.expm1(d) - d).sum(), int(d.numel()))

    def add(self, other: MismatchStats) -> None:
        if not other.tokens:
            return
        self.abs_sum = self.abs_sum + other.abs_sum
        self.k3_sum = self.k3_sum + other.k3_sum
        self.abs_max = other.abs_max if not self.tokens else torch.maximum(torch.as_tensor(self.abs_max),
                                                                          torch.as_tensor(other.abs_max))
        self.tokens += other.tokens

    def totals(self) -> list[float]:
        """``[abs_sum, abs_max, k3_sum, tokens]`` as floats (one device read)."""
        values = [self.abs_sum, self.abs_max, self.k3_sum]
        if any(isinstance(v, torch.Tensor) for v in values):
            values = torch.stack([torch.as_tensor(v, dtype=torch.float64).to("cpu") for v in values]).tolist()
        return [float(v) for v in values] + [float(self.tokens)]


def summary(abs_sum: float, abs_max: float, k3_sum: float, tokens: float) -> dict[str, float]:
    """The logged ``mismatch/*`` values of summed totals (``{}`` when no token was compared)."""
    if not tokens:
        return {}
    return {"mismatch/logp_abs_diff_mean": abs_sum / tokens, "mismatch/logp_abs_diff_max": abs_max,
            "mismatch/kl_k3": k3_sum / tokens, "mismatch/tokens": tokens}
