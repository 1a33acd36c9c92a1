"""ms-swift conformance: our rollout client and server against the real ms-swift processes (one or two GPUs),
both directions.

``python -m trainer.conformance --out DIR [--only rollout|rlhf] [--size text|4b]`` writes
``DIR/swift_peers.json`` and keeps every subprocess's full log in ``DIR/logs/``:

* ``rollout`` (``trainer.conformance.rollout``): the real ``swift rollout`` (built by our launcher,
  ``trainer.launch.commands.swift_rollout_command``) on a small random-weight Qwen3 text model, driven by OUR client (``ServerRolloutEngine``, in a subprocess of its
  own): ``/health/``, the engine-type probe, a batch of 8 requests x 64 new tokens, a full weight sync through
  ``sync.transport: nccl`` (the only transport ``swift rollout`` has), a generate after it (same client, then a
  fresh one);
* ``rlhf`` (``trainer.conformance.rlhf``): ms-swift's GRPO trainer (``swift rlhf``, argv built by our launcher from
  ``configs/summary_1024_attr_key_recall.yaml`` shrunk to the tiny model, ``use_vllm: true``, ``vllm_mode: server``)
  against OUR server (``python -m trainer serve --engine vllm``), 2 steps. Sampling at ``GRPO_TEMPERATURE`` (1.0),
  and besides the config's summary rewards (constant at random weights: no parseable summary) the run scores
  ``signal.length_distinct`` (``trainer/grpo/signal_reward.py``, added to the argv with its plugin), which differs
  between a prompt's completions, so GRPO has advantages to learn from; every step's reward, reward_std,
  frac_reward_zero_std, loss and grad_norm are read from ms-swift's logs into ``rlhf.per_step``, and
  ``rlhf.learning_signal`` says whether every step (after the first) had reward_std > 0 and grad_norm > 0
  (``trainer.grpo.signal_reward``; read by ``trainer.conformance.swift_logs``).

On one GPU the NCCL weight sync puts two ranks on the same device, which NCCL refuses; whatever happens is recorded
(error text, log excerpts), never hidden. ``protocol_findings`` lists what the peers did that disagrees with our
protocol code: non-2xx answers in either server's access log, endpoint answers whose fields differ between
``swift rollout`` and our server, and routes one server has and the other lacks (``trainer.conformance.protocol``).

Never hangs: every subprocess runs in its own session with a timeout and its whole process group is killed at the
end (``trainer.conformance.peers``); one global deadline (``BUDGET_S``, under 8 minutes) bounds the run.

Where it sits: above ``trainer.bench`` (it starts its peers with ``trainer.bench.processes`` and builds its random
models with ``trainer.bench.models``), beside no other package: nothing in ``trainer`` imports it.
"""
