"""Summary-GRPO config: the shipped configs resolve to the seed-004 topology, and every fail-fast rule fires
with the key path to change."""

from __future__ import annotations

import pytest

from tests.grpo.conftest import REPO, SUMMARY_CONFIGS
from trainer.config.errors import ConfigError, ConfigErrors
from trainer.config.grpo import (
    IGNORED_IN_SERVER_MODE,
    RlhfConfig,
    check_grpo,
    grpo_sections,
    is_local_host,
    server_urls,
    validate_grpo,
)
from trainer.config.loader import resolve_yaml
from trainer.config.schema import TrainConfig, validate_config


@pytest.mark.parametrize("path", SUMMARY_CONFIGS)
def test_shipped_configs_resolve_to_server_mode_topology(path):
    cfg = resolve_yaml(REPO / path)
    typed = validate_config(cfg, source=path)
    assert validate_grpo(typed) == []
    s = grpo_sections(typed)
    assert s.trainer_variant == "grpo_summary"
    r, rs = s.rlhf, s.rollout_server
    assert (r.use_vllm, r.vllm_mode, r.vllm_server_host, r.vllm_server_port) == (True, "server", ["127.0.0.1"], [8080])
    assert r.vllm_max_model_len is None  # the server's value is the source of truth
    assert (rs.vllm_tensor_parallel_size, rs.vllm_data_parallel_size) == (1, 6)
    assert (rs.vllm_gpu_memory_utilization, rs.vllm_enable_lora) == (0.6, False)
    assert rs.vllm_max_model_len == 8192
    assert rs.gpus == [0, 1, 2, 3, 4, 5] and rs.learner_gpus == [6, 7]
    assert (r.num_generations, r.temperature, r.repetition_penalty, r.max_completion_length) == (4, 0.7, 1.05, 2048)
    assert (r.beta, r.advantage_estimator, r.scale_rewards, r.kl_in_reward) == (0.04, "reinforce_plus_plus", "batch", True)
    assert r.dynamic_sample and r.generation_batch_size == 24
    assert len(r.reward_funcs) == len(r.reward_weights)
    assert server_urls(s) == ["http://127.0.0.1:8080"]
    assert cfg["tuner"]["train_type"] == "dora" and cfg["tuner"]["freeze_vit"] is False


def test_variants_differ_only_in_rewards():
    base = resolve_yaml(REPO / SUMMARY_CONFIGS[0])
    attr = resolve_yaml(REPO / SUMMARY_CONFIGS[1])
    weights = dict(zip(attr["rlhf"]["reward_funcs"], attr["rlhf"]["reward_weights"]))
    assert weights["summary.schema_tree"] == 5.0 and weights["summary.attr_key_recall"] == 1.5
    assert "summary.text_bbu" not in weights
    base_w = dict(zip(base["rlhf"]["reward_funcs"], base["rlhf"]["reward_weights"]))
    assert base_w == {"summary.format": 1.0, "summary.header": 2.0, "summary.strict": 2.0, "summary.parse": 1.5,
                      "summary.no_dup_keys": 2.0, "summary.dataset": 0.5, "summary.category_recall": 0.5,
                      "summary.content_structured_tversky": 1.8, "summary.text_bbu": 0.8, "summary.notes_bbu": 0.3,
                      "summary.group_stats_presence": 0.2}
    for key in ("rlhf", "custom"):
        a, b = dict(attr[key]), dict(base[key])
        if key == "rlhf":
            for k in ("reward_funcs", "reward_weights"):
                a.pop(k), b.pop(k)
        assert a == b


def _typed(cfg: dict) -> TrainConfig:
    """The typed config ``check_grpo`` reads: field validation only (the schema's other rules not applied)."""
    return TrainConfig.model_validate(cfg)


def _errors(cfg) -> dict[str, str]:
    """Key path → its messages joined (one key can break several rules), as ``validate_config`` reports them:
    field errors from the schema, then the GRPO rules (``check_grpo``) on the typed config."""
    try:
        validate_config(cfg)
        errors = []
    except ConfigErrors as exc:
        errors = exc.errors
    out: dict[str, str] = {}
    for e in errors:
        out[e.key_path] = (out[e.key_path] + " | " if e.key_path in out else "") + e.message
    return out


def _rs(cfg) -> dict:
    return cfg["custom"]["extra"]["rollout_server"]


def test_server_mode_requires_rollout_server(summary_cfg):
    del summary_cfg["custom"]["extra"]
    errs = _errors(summary_cfg)
    assert "custom.extra.rollout_server" in errs and "required when rlhf.vllm_mode is server" in errs["custom.extra.rollout_server"]
    with pytest.raises(ConfigError) as exc:
        validate_grpo(_typed(summary_cfg))
    assert exc.value.key_path == "custom.extra.rollout_server"


@pytest.mark.parametrize("key,value,needle", [
    ("vllm_server_host", [], "non-empty list of host names"),
    ("vllm_server_port", [], "non-empty list of ports"),
    ("vllm_server_port", [70000], "1..65535"),
])
def test_host_and_port_must_be_non_empty_lists(summary_cfg, key, value, needle):
    summary_cfg["rlhf"][key] = value
    errs = _errors(summary_cfg)
    assert needle in errs[f"rlhf.{key}"]


def test_single_node_requires_local_hosts(summary_cfg):
    summary_cfg["rlhf"]["vllm_server_host"] = ["10.0.0.5"]
    assert "requires local hosts" in _errors(summary_cfg)["rlhf.vllm_server_host"]
    summary_cfg["rlhf"]["vllm_server_host"] = ["localhost"]
    assert _errors(summary_cfg) == {}


def test_host_port_pairs_and_one_server(summary_cfg):
    summary_cfg["rlhf"]["vllm_server_port"] = [8080, 8081]
    assert "give one port per host" in _errors(summary_cfg)["rlhf.vllm_server_port"]
    summary_cfg["rlhf"]["vllm_server_host"] = ["127.0.0.1", "127.0.0.1"]
    assert "one rollout server" in _errors(summary_cfg)["rlhf.vllm_server_host"]


def test_server_gpus_must_equal_tp_times_dp(summary_cfg):
    _rs(summary_cfg)["gpus"] = [0, 1, 2, 3]
    msg = _errors(summary_cfg)["custom.extra.rollout_server.gpus"]
    assert "1 × 6 = 6" in msg
    _rs(summary_cfg).update(vllm_tensor_parallel_size=2, vllm_data_parallel_size=2)
    assert "custom.extra.rollout_server.gpus" not in _errors(summary_cfg)


def test_server_and_learner_gpus_disjoint(summary_cfg):
    _rs(summary_cfg)["learner_gpus"] = [5, 6]
    assert "GPU(s) [5]" in _errors(summary_cfg)["custom.extra.rollout_server.learner_gpus"]


def test_gpu_lists_reject_repeats(summary_cfg):
    _rs(summary_cfg)["gpus"] = [0, 0, 1, 2, 3, 4]
    assert "unique" in _errors(summary_cfg)["custom.extra.rollout_server.gpus"]


def test_vllm_lora_forbidden(summary_cfg):
    _rs(summary_cfg)["vllm_enable_lora"] = True
    assert "full-weight sync" in _errors(summary_cfg)["custom.extra.rollout_server.vllm_enable_lora"]


def test_max_model_len_must_cover_completion_and_learner_length(summary_cfg):
    _rs(summary_cfg)["vllm_max_model_len"] = 2048
    assert "no room for the prompt" in _errors(summary_cfg)["custom.extra.rollout_server.vllm_max_model_len"]
    _rs(summary_cfg)["vllm_max_model_len"] = 4096
    assert "exceeds the server's" in _errors(summary_cfg)["rlhf.max_length"]


def test_max_model_len_is_required_on_the_server(summary_cfg):
    del _rs(summary_cfg)["vllm_max_model_len"]
    errs = _errors(summary_cfg)
    assert "custom.extra.rollout_server.vllm_max_model_len" in errs


def test_rollout_server_endpoint_must_match_learner(summary_cfg):
    _rs(summary_cfg)["port"] = 9000
    assert "differs from rlhf.vllm_server_port[0] 8080" in _errors(summary_cfg)["custom.extra.rollout_server.port"]


def test_unknown_rollout_server_key_names_path(summary_cfg):
    _rs(summary_cfg)["vllm_tensor_parallel"] = 1
    errs = _errors(summary_cfg)
    assert list(errs) == ["custom.extra.rollout_server.vllm_tensor_parallel"]
    assert "vllm_tensor_parallel_size" in errs["custom.extra.rollout_server.vllm_tensor_parallel"]


def test_reward_list_rules(summary_cfg):
    summary_cfg["rlhf"]["reward_weights"] = [1.0]
    assert "1 weight(s) for 11 reward function(s)" in _errors(summary_cfg)["rlhf.reward_weights"]
    summary_cfg["rlhf"]["reward_weights"] = None
    summary_cfg["rlhf"]["reward_funcs"] = ["summary.format", "summary.nope"]
    assert "summary.nope" in _errors(summary_cfg)["rlhf.reward_funcs"]
    summary_cfg["rlhf"]["reward_funcs"] = []
    assert "at least one reward" in _errors(summary_cfg)["rlhf.reward_funcs"]


def test_generation_batch_divisibility(summary_cfg):
    summary_cfg["rlhf"]["generation_batch_size"] = 18
    msg = _errors(summary_cfg)["rlhf.generation_batch_size"]
    assert "num_generations=4" in msg and "4 × 2 = 8" in msg
    summary_cfg["rlhf"]["generation_batch_size"] = 12  # divisible by 4 generations, not by 4 × 2 learner ranks
    msg = _errors(summary_cfg)["rlhf.generation_batch_size"]
    assert "4 × 2 = 8" in msg and "num_generations" not in msg


def test_server_mode_needs_use_vllm(summary_cfg):
    summary_cfg["rlhf"]["use_vllm"] = False
    errs = _errors(summary_cfg)
    assert "rlhf.use_vllm" in errs and "rlhf.vllm_mode" in errs


def test_wrong_variant_is_reported(summary_cfg):
    summary_cfg["custom"]["trainer_variant"] = "rollout_matching_sft"
    errors, _ = check_grpo(_typed(summary_cfg))
    assert any(e.key_path == "custom.trainer_variant" and "grpo_summary" in e.message for e in errors)
    # through the schema, the stage-2 variant's missing section is named, with the variant key that asks for it
    msg = _errors(summary_cfg)["custom.extra.rollout_matching"]
    assert "custom.trainer_variant is rollout_matching_sft" in msg


def test_missing_rlhf_section():
    with pytest.raises(ConfigError) as exc:
        validate_grpo(_typed({"model": {"tiny": "text"}, "data": {"train_jsonl": "train.jsonl"},
                              "custom": {"trainer_variant": "grpo_summary"}}))
    assert exc.value.key_path == "rlhf"


def test_fields_ignored_for_external_vllm_are_reported(summary_cfg):
    summary_cfg["rlhf"].update(vllm_max_model_len=4096, vllm_gpu_memory_utilization=0.9, sleep_level=1)
    warnings = validate_grpo(_typed(summary_cfg))
    assert len(warnings) == 3
    joined = "\n".join(warnings)
    assert "rlhf.vllm_max_model_len=4096 is ignored" in joined
    assert "custom.extra.rollout_server.vllm_max_model_len" in joined
    assert "rlhf.sleep_level" in joined
    assert set(IGNORED_IN_SERVER_MODE) <= set(RlhfConfig.model_fields)


def test_colocate_mode_ignores_server_section_with_warning(summary_cfg):
    summary_cfg["rlhf"]["vllm_mode"] = "colocate"
    errors, warnings = check_grpo(_typed(summary_cfg))
    assert errors == [] and any("only used when rlhf.vllm_mode is server" in w for w in warnings)


def test_rules_read_the_typed_config(summary_cfg):
    typed = validate_config(summary_cfg)
    assert validate_grpo(typed) == []
    assert grpo_sections(typed).rlhf is typed.rlhf
    typed.custom.extra.rollout_server.learner_gpus = [0, 6]
    with pytest.raises(ConfigError, match="disjoint"):
        validate_grpo(typed)


@pytest.mark.parametrize("host,local", [("127.0.0.1", True), ("127.0.0.9", True), ("::1", True),
                                        ("localhost", True), ("0.0.0.0", False), ("10.1.2.3", False),
                                        ("node-7", False)])
def test_is_local_host(host, local):
    assert is_local_host(host) is local
