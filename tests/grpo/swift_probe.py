"""Run in a subprocess by ``test_swift_args.py``: constructs ms-swift's own argument classes from our mapped
command lines and scores completions through ms-swift's reward path, printing one JSON object.

Kept out of the pytest process because ms-swift's argument classes mutate process state (RANK/WORLD_SIZE
environment, a DataLoader patch). Hardware-only checks are simulated, and only those: the visible GPU count
(``swift rollout`` requires TP × DP devices), bf16 GPU support, and the learner's NCCL weight-sync handshake
with the server (``RLHFArguments._init_external_vllm``), which is recorded instead of performed.
"""

from __future__ import annotations

import json
import sys
from unittest import mock


def rollout(argv: list[str], device_count: int) -> dict:
    import swift.arguments.deploy_args as deploy_args
    from swift.arguments import RolloutArguments
    from swift.utils import parse_args

    with mock.patch.object(deploy_args, "get_device_count", return_value=device_count):
        try:
            args, rest = parse_args(RolloutArguments, argv)
        except ValueError as exc:
            return {"error": str(exc)}
    keys = ("model", "model_type", "host", "port", "vllm_tensor_parallel_size", "vllm_data_parallel_size",
            "vllm_max_model_len", "vllm_gpu_memory_utilization", "vllm_enable_lora", "vllm_limit_mm_per_prompt")
    out = {k: getattr(args, k) for k in keys}
    out.update(rest=rest, torch_dtype=str(args.torch_dtype))
    return out


def rlhf(argv: list[str], dataset: str) -> dict:
    import torch
    import transformers.training_args as hf_training_args
    from swift.arguments import RLHFArguments
    from swift.rewards import orms
    from swift.rl_core.data import GRPOSample
    from swift.rl_core.grpo_algorithm import compute_rewards_per_func
    from swift.utils import parse_args

    handshakes = []

    def record_handshake(self):
        handshakes.append({"hosts": self.vllm_server_host, "ports": self.vllm_server_port,
                           "timeout": self.vllm_server_timeout})

    with mock.patch.object(RLHFArguments, "_init_external_vllm", record_handshake), \
            mock.patch.object(hf_training_args, "is_torch_bf16_gpu_available", return_value=True):
        args, rest = parse_args(RLHFArguments, argv)
    t = args.training_args
    out = {
        "rest": rest, "handshakes": handshakes, "training_args_class": type(t).__name__,
        "args": {k: getattr(args, k) for k in ("rlhf_type", "tuner_type", "use_dora", "lora_rank", "lora_alpha",
                                                "freeze_vit", "freeze_aligner", "max_length", "model_type",
                                                "reward_funcs", "reward_weights", "dataset", "external_plugins")},
        "training": {k: getattr(t, k) for k in ("use_vllm", "vllm_mode", "vllm_server_host", "vllm_server_port",
                                                "vllm_server_timeout", "num_generations", "temperature",
                                                "repetition_penalty", "max_completion_length", "beta",
                                                "advantage_estimator", "scale_rewards", "kl_in_reward",
                                                "dynamic_sample", "generation_batch_size", "steps_per_generation",
                                                "learning_rate", "per_device_train_batch_size",
                                                "gradient_accumulation_steps", "bf16")},
        "zero_stage": (t.deepspeed or {}).get("zero_optimization", {}).get("stage"),
        "registered": sorted(k for k in orms if k.startswith("summary.")),
    }
    rows = [json.loads(line) for line in open(dataset, encoding="utf-8")]
    samples = []
    for row in rows:
        for completion in (row["summary_ref"], "not a summary"):
            r = dict(row, messages=row["messages"] + [{"role": "assistant", "content": completion}])
            samples.append(GRPOSample.from_row(r))
    funcs = [orms[name](args=t) for name in args.reward_funcs]
    rewards = compute_rewards_per_func(samples, funcs, None, device=torch.device("cpu"))
    out["rewards"] = rewards.tolist()
    out["reward_rows"] = [{"summary_ref": s.to_reward_row()["summary_ref"], "domain": s.to_reward_row()["metadata"]["domain"],
                           "completion": s.messages[-1]["content"]} for s in samples]
    return out


def main() -> None:
    spec = json.loads(sys.argv[1])
    result = {}
    for name, case in spec.items():
        if case["kind"] == "rollout":
            result[name] = rollout(case["argv"], case["device_count"])
        else:
            result[name] = rlhf(case["argv"], case["dataset"])
    print("PROBE-RESULT " + json.dumps(result, ensure_ascii=False, default=str))


if __name__ == "__main__":
    main()
