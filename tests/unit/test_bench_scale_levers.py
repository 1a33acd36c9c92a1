"""The scale bench's lever knobs (``RM_BENCH_SCALE_LIGER`` / ``_CKPT`` / ``_OPTIM``): the names, the stage-2 config
each produces, several values beside the default in one call, and (``--quick`` on the CPU) the record of what ran."""

from __future__ import annotations

import dataclasses

import pytest

from trainer.bench import scale
from trainer.config.schema import validate_config


def _env(liger=None, ckpt=None, optim=None) -> dict[str, str | None]:
    """The three learner knobs as the bench reads them from the environment."""
    return {"RM_BENCH_SCALE_LIGER": liger, "RM_BENCH_SCALE_CKPT": ckpt, "RM_BENCH_SCALE_OPTIM": optim}

def test_unset_knobs_leave_every_run_as_it_was(tmp_path):
    assert scale.lever_knobs({}) == [{}] and scale.lever_knobs(_env("", "", "")) == [{}]
    runs = scale.selected("2b,8b-lora64-sleep2-util0.35")
    assert scale.with_levers(runs, [{}]) == runs
    training = validate_config(scale.stage2_config(runs[0], tmp_path / "m", tmp_path / "o", "vllm")).training
    assert (training.checkpointing_policy, training.optim, training.use_liger_kernel) == \
        ("full", "adamw_torch_fused", False), "the rows measured so far: full checkpointing, fused AdamW, no Liger"
    assert "gradient_checkpointing_policy" not in training.model_fields_set


@pytest.mark.parametrize("liger, ckpt, optim, suffix, expected", [
    ("1", None, None, "-liger", dict(use_liger_kernel=True)),
    (None, "selective", None, "-ckptselective", dict(checkpointing_policy="selective")),
    (None, "off", None, "-ckptoff", dict(checkpointing_policy="off")),
    (None, "auto", None, "-ckptauto", dict(checkpointing_policy="auto")),
    (None, "full", None, "", dict(checkpointing_policy="full")),
    (None, None, "adamw_torch", "-unfusedadam", dict(optim="adamw_torch")),
    (None, None, "adamw_torch_fused", "", dict(optim="adamw_torch_fused")),
    ("1", "selective", "adamw_torch", "-liger-ckptselective-unfusedadam",
     dict(use_liger_kernel=True, checkpointing_policy="selective", optim="adamw_torch")),
])
def test_each_knob_names_the_run_and_reaches_its_config(tmp_path, liger, ckpt, optim, suffix, expected):
    for base in scale.selected("2b,4b,8b-lora64-sleep2-util0.35"):
        (knob,) = scale.lever_knobs(_env(liger, ckpt, optim))
        run = dataclasses.replace(base, **knob)
        assert run.name == base.name + suffix
        t = validate_config(scale.stage2_config(run, tmp_path / "m", tmp_path / "o", "vllm")).training
        assert {k: getattr(t, k) for k in expected} == expected


def test_several_values_run_beside_the_default_in_one_call():
    runs = scale.with_levers(scale.selected("2b"), scale.lever_knobs(_env("0,1", "full,selective")))
    assert [r.name for r in runs] == ["2b-full-sleep2-util0.3", "2b-full-sleep2-util0.3-ckptselective",
                                      "2b-full-sleep2-util0.3-liger", "2b-full-sleep2-util0.3-liger-ckptselective"]
    knobs = scale.lever_knobs({"RM_BENCH_SCALE_OPTIM": "adamw_torch_fused,adamw_torch"})
    names = [r.name for r in scale.with_levers(scale.selected("4b"), knobs)]
    assert names == ["4b-full-sleep2-util0.2", "4b-full-sleep2-util0.2-unfusedadam"]


@pytest.mark.parametrize("liger, ckpt, optim, env", [("yes", None, None, "RM_BENCH_SCALE_LIGER"),
                                                     (None, "partial", None, "RM_BENCH_SCALE_CKPT"),
                                                     (None, "full,sometimes", None, "RM_BENCH_SCALE_CKPT"),
                                                     (None, None, "adafactor", "RM_BENCH_SCALE_OPTIM"),
                                                     (None, ",", None, "RM_BENCH_SCALE_CKPT")])
def test_bad_knob_values_are_refused_with_the_variable(liger, ckpt, optim, env):
    with pytest.raises(SystemExit, match=env):
        scale.lever_knobs(_env(liger, ckpt, optim))


def test_hfu_counts_the_recompute_of_the_layers_that_ran_checkpointed():
    assert scale.recomputed_fraction({}, True) is True and scale.recomputed_fraction({}, False) is False
    assert scale.recomputed_fraction({"checkpointed_layers": 28, "decoder_layers": 28}, False) is True
    assert scale.recomputed_fraction({"checkpointed_layers": 14, "decoder_layers": 28}, True) == 0.5
    assert scale.recomputed_fraction({"checkpointed_layers": 0, "decoder_layers": 28}, True) == 0.0
    full = scale.fwd_bwd_flops("2b", 16_000, 8, 4096, checkpointing=True)
    half = scale.fwd_bwd_flops("2b", 16_000, 8, 4096, checkpointing=0.5)
    none = scale.fwd_bwd_flops("2b", 16_000, 8, 4096, checkpointing=0.0)
    assert full["model"] == half["model"] == none["model"] == none["hardware"]
    assert half["hardware"] - half["model"] == pytest.approx((full["hardware"] - full["model"]) / 2, rel=1e-12)


def test_quick_bench_records_the_levers_that_ran(tmp_path, monkeypatch):
    monkeypatch.setenv("RM_BENCH_WORK", str(tmp_path / "work"))
    monkeypatch.setenv("RM_BENCH_SCALE_CKPT", "selective")
    monkeypatch.setenv("RM_BENCH_SCALE_OPTIM", "adamw_torch")
    (rec,) = scale.run(tmp_path / "out", quick=True)["runs"]
    assert rec["name"] == "tiny-full-sleep2-util0.3-ckptselective-unfusedadam" and "error" not in rec, rec
    levers = rec["levers"]
    assert (levers["checkpointing_policy"], levers["checkpointed_layers"], levers["decoder_layers"]) == \
        ("selective", 1, 2)
    assert (levers["optim"], levers["use_liger_kernel"]) == ("adamw_torch", False)
    assert rec["flops"]["checkpointing"] == 0.5, "HFU counts the recompute of half the layers"


def test_prewake_knob_runs_both_and_reaches_the_sync_config(tmp_path):
    runs = scale.with_levers(scale.selected("8b-lora64-sleep2-util0.35"),
                             scale.lever_knobs({"RM_BENCH_SCALE_PREWAKE": "1,0"}))
    assert [r.prewake for r in runs][:2] == [True, False]
    assert runs[0].name.endswith("-prewake") and not runs[1].name.endswith("prewake"), "the default (off) has no suffix"
    cfg = scale.stage2_config(runs[1], tmp_path, tmp_path / "out", "vllm")
    assert cfg["custom"]["extra"]["rollout_matching"]["vllm"]["sync"]["prewake"] is False
    from trainer.config.schema import validate_config

    assert validate_config(cfg).custom.extra.rollout_matching.vllm.sync.prewake is False
    assert validate_config(scale.stage2_config(scale.selected("8b-lora64-sleep2-util0.35")[0], tmp_path, tmp_path / "o",
                                               "vllm")).custom.extra.rollout_matching.vllm.sync.prewake is False
    with pytest.raises(SystemExit, match="RM_BENCH_SCALE_PREWAKE"):
        scale.lever_knobs({"RM_BENCH_SCALE_PREWAKE": "yes"})


def test_overlap_wake_knob_runs_both_reaches_the_sync_config_and_leaves_out_prewake(tmp_path, capsys):
    from trainer.config.schema import validate_config

    runs = scale.with_levers(scale.selected("8b-lora64-sleep2-util0.35"), scale.lever_knobs(
        {"RM_BENCH_SCALE_OVERLAPWAKE": "0,1", "RM_BENCH_SCALE_PREWAKE": "0,1"}))
    assert [r.name for r in runs] == ["8b-lora64-sleep2-util0.35", "8b-lora64-sleep2-util0.35-overlapwake",
                                      "8b-lora64-sleep2-util0.35-prewake"]
    assert "8b-lora64-sleep2-util0.35-prewake-overlapwake: left out: custom.extra.rollout_matching.vllm.sync: " \
        "sync.overlap_wake and sync.prewake both wake" in \
        capsys.readouterr().out
    sync = validate_config(scale.stage2_config(runs[1], tmp_path, tmp_path / "o", "vllm")
                           ).custom.extra.rollout_matching.vllm.sync
    assert (sync.overlap_wake, sync.prewake) == (True, False)
    with pytest.raises(SystemExit, match="no run left: .*sync.overlap_wake and sync.prewake both wake"):
        scale.with_levers(scale.selected("2b"), scale.lever_knobs(
            {"RM_BENCH_SCALE_OVERLAPWAKE": "1", "RM_BENCH_SCALE_PREWAKE": "1"}))


def test_merge_into_engine_knob_runs_beside_off_reaches_the_sync_config_and_leaves_out_what_it_needs(tmp_path, capsys):
    runs = scale.with_levers(scale.selected("8b-lora64-sleep2-util0.35,4b"), scale.lever_knobs(
        {"RM_BENCH_SCALE_MERGEIN": "0,1", "RM_BENCH_SCALE_RECLOAD": "1"}))
    assert [r.name for r in runs] == ["4b-full-sleep2-util0.2-recload", "8b-lora64-sleep2-util0.35-recload",
                                      "8b-lora64-sleep2-util0.35-recload-mergein"]
    assert "4b-full-sleep2-util0.2-recload-mergein: left out: vllm.sync.merge_into_engine has no LoRA merge" in \
        capsys.readouterr().out
    vllm = validate_config(scale.stage2_config(runs[2], tmp_path, tmp_path / "o", "vllm")
                           ).custom.extra.rollout_matching.vllm
    assert (vllm.sync.merge_into_engine, vllm.sync.recorded_load, vllm.sleep_level) == (True, True, 2)
    for env, config_says in (({"RM_BENCH_SCALE_RECLOAD": "0"}, "merge_into_engine writes through the recorded load"),
                             ({"RM_BENCH_SCALE_SLEEP": "kv_cache", "RM_BENCH_SCALE_RECLOAD": "1"},
                              "needs mode: colocate and sleep_level: 2"),
                             ({"RM_BENCH_SCALE_OVERLAPWAKE": "1", "RM_BENCH_SCALE_RECLOAD": "1"},
                              "merge_into_engine checks the weights after writing them")):
        with pytest.raises(SystemExit, match=f"no run left: .*{config_says}"):
            scale.with_levers(scale.selected("8b-lora64-sleep2-util0.35"),
                              scale.lever_knobs({"RM_BENCH_SCALE_MERGEIN": "1", **env}))


def test_a_left_out_combination_is_worded_by_the_config_itself(tmp_path):
    """The bench asks ``validate_config`` rather than restating its rules: any problem the config finds in a run's
    config, also one no knob rule names, leaves the run out in the config's words."""
    from dataclasses import replace

    run = scale.selected("8b-lora64-sleep2-util0.35")[0]
    assert scale.refused_combination(run) is None
    bad = replace(run, gpu_memory_utilization=1.5)
    reason = scale.refused_combination(bad)
    assert reason is not None and "gpu_memory_utilization" in reason


def test_compile_knob_is_an_axis_eager_and_compiled_in_one_call(tmp_path):
    knobs = scale.lever_knobs({**_env(ckpt="full,selective"), "RM_BENCH_SCALE_COMPILE": "0,1"})
    runs = scale.with_levers(scale.selected("2b"), knobs)
    assert [(r.checkpointing, r.compile_layers) for r in runs] == [("full", False), ("full", True),
                                                                  ("selective", False), ("selective", True)]
    assert runs[1].name.endswith("-compiled") and "compiled" not in runs[0].name
    from trainer.config.schema import validate_config

    assert validate_config(scale.stage2_config(runs[1], tmp_path, tmp_path / "o", "vllm")).training.compile_decoder_layers
    assert not validate_config(scale.stage2_config(runs[0], tmp_path, tmp_path / "o",
                                                   "vllm")).training.compile_decoder_layers
    with pytest.raises(SystemExit, match="RM_BENCH_SCALE_COMPILE"):
        scale.lever_knobs({"RM_BENCH_SCALE_COMPILE": "true"})
    knobs = scale.lever_knobs({**_env("1"), "RM_BENCH_SCALE_COMPILE": "1"})
    with pytest.raises(SystemExit, match="no run left: training: use_liger_kernel and compile_decoder_layers do not "
                       "combine"):
        scale.with_levers(scale.selected("2b"), knobs)


def test_recorded_load_knob_reaches_the_sync_config(tmp_path):
    from trainer.config.schema import validate_config

    runs = scale.with_levers(scale.selected("8b-lora64-sleep2-util0.35"),
                             scale.lever_knobs({"RM_BENCH_SCALE_RECLOAD": "0,1"}))
    assert [r.recorded_load for r in runs] == [False, True] and runs[1].name.endswith("-recload")
    for r in runs:
        cfg = validate_config(scale.stage2_config(r, tmp_path, tmp_path / "o", "vllm"))
        assert cfg.custom.extra.rollout_matching.vllm.sync.recorded_load is r.recorded_load


def test_sleep_knob_runs_level_2_beside_the_kv_cache_sleep_and_reaches_the_vllm_config(tmp_path):
    from trainer.config.schema import validate_config

    runs = scale.with_levers(scale.selected("8b-lora64-sleep2-util0.35"),
                             scale.lever_knobs({"RM_BENCH_SCALE_SLEEP": "2,kv_cache"}))
    assert [r.sleep_level for r in runs] == [2, "kv_cache"]
    assert runs[0].name == "8b-lora64-sleep2-util0.35" and runs[1].name == "8b-lora64-sleepkv-util0.35"
    for r in runs:
        cfg = validate_config(scale.stage2_config(r, tmp_path, tmp_path / "o", "vllm"))
        assert cfg.custom.extra.rollout_matching.vllm.sleep_level == r.sleep_level
    with pytest.raises(SystemExit, match="RM_BENCH_SCALE_SLEEP"):
        scale.lever_knobs({"RM_BENCH_SCALE_SLEEP": "3"})


def test_pixels_knob_makes_the_training_pixels_during_the_decode_on_the_gpu_only(tmp_path):
    from trainer.config.schema import validate_config

    runs = scale.with_levers(scale.selected("4b"), scale.lever_knobs({"RM_BENCH_SCALE_PIXELS": "0,1"}))
    assert [r.pixels_during_decode for r in runs] == [False, True]
    assert runs[0].name == "4b-full-sleep2-util0.2" and runs[1].name == "4b-full-sleep2-util0.2-pixels"
    for r in runs:
        cfg = validate_config(scale.stage2_config(r, tmp_path, tmp_path / "o", "vllm"))
        assert cfg.custom.extra.rollout_matching.vllm.pixels_during_decode is r.pixels_during_decode
    hf = validate_config(scale.stage2_config(runs[1], tmp_path, tmp_path / "o", "hf"))  # the CPU --quick backend
    assert hf.custom.extra.rollout_matching.rollout_backend == "hf"
    assert not hf.custom.extra.rollout_matching.vllm.pixels_during_decode
    with pytest.raises(SystemExit, match="RM_BENCH_SCALE_PIXELS"):
        scale.lever_knobs({"RM_BENCH_SCALE_PIXELS": "on"})


@pytest.mark.parametrize("env, values, field, want, suffix", [
    ("RM_BENCH_SCALE_PHASE_TIMING", "events,sync", "phase_timing", ["events", "sync"], "-phasesync"),
    ("RM_BENCH_SCALE_HOST_VISION", "1,0", "host_vision_metadata", [True, False], "-devicevision"),
    ("RM_BENCH_SCALE_VARLEN", "op,api", "varlen_kernel", ["op", "api"], "-varlenapi"),
])
def test_training_knobs_run_beside_the_default_and_reach_the_training_config(tmp_path, env, values, field, want,
                                                                            suffix):
    from trainer.config.schema import validate_config

    runs = scale.with_levers(scale.selected("4b"), scale.lever_knobs({env: values}))
    assert [getattr(r, field) for r in runs] == want
    assert runs[0].name == "4b-full-sleep2-util0.2" and runs[1].name == "4b-full-sleep2-util0.2" + suffix
    for r in runs:
        cfg = validate_config(scale.stage2_config(r, tmp_path, tmp_path / "o", "vllm"))
        assert getattr(cfg.training, {"varlen_kernel": "packed_varlen_kernel"}.get(field, field)) == getattr(r, field)
    with pytest.raises(SystemExit, match=env):
        scale.lever_knobs({env: "maybe"})


def test_packing_length_knob_runs_each_length_and_reaches_the_training_config(tmp_path):
    from trainer.config.schema import validate_config

    runs = scale.with_packing_lengths(scale.selected("4b"), "16384,8192")
    assert [r.packing_length for r in runs] == [16384, 8192]
    assert runs[0].name == "4b-full-sleep2-util0.2" and runs[1].name.endswith("-pack8192")
    assert validate_config(scale.stage2_config(runs[1], tmp_path, tmp_path / "o", "vllm")).training.packing_length \
        == 8192
    assert scale.with_packing_lengths(runs[:1], None) == runs[:1]
    for bad in ("8k", "512", ","):
        with pytest.raises(SystemExit, match="RM_BENCH_SCALE_PACKING"):
            scale.with_packing_lengths(runs, bad)


def test_memory_budget_knob_runs_only_where_the_config_takes_it(tmp_path, capsys):
    """``RM_BENCH_SCALE_MEMBUDGET``: a budget below 1 beside compiled layers that are not all checkpointed; a
    combination the config would refuse is left out with a printed line, and nothing left is refused."""
    env = {"RM_BENCH_SCALE_COMPILE": "1", "RM_BENCH_SCALE_CKPT": "full,off", "RM_BENCH_SCALE_MEMBUDGET": "1,0.4"}
    runs = scale.with_levers(scale.selected("4b"), scale.lever_knobs(env))
    assert [r.name for r in runs] == ["4b-full-sleep2-util0.2-compiled", "4b-full-sleep2-util0.2-compiled-ckptoff",
                                      "4b-full-sleep2-util0.2-compiled-ckptoff-membudget0.4"]
    assert "4b-full-sleep2-util0.2-compiled-membudget0.4: left out" in capsys.readouterr().out
    t = validate_config(scale.stage2_config(runs[-1], tmp_path / "m", tmp_path / "o", "vllm")).training
    assert (t.checkpointing_policy, t.compile_activation_memory_budget) == ("off", 0.4)
    auto = scale.with_levers(scale.selected("8b-lora64-sleep2-util0.35"), scale.lever_knobs(
        {"RM_BENCH_SCALE_COMPILE": "1", "RM_BENCH_SCALE_CKPT": "auto,off", "RM_BENCH_SCALE_MEMBUDGET": "auto"}))
    assert [r.name for r in auto] == ["8b-lora64-sleep2-util0.35-compiled-ckptauto-membudgetauto"]
    t = validate_config(scale.stage2_config(auto[0], tmp_path / "m", tmp_path / "o", "vllm")).training
    assert t.compile_activation_memory_budget == "auto"
    with pytest.raises(SystemExit, match="no run left: training: compile_activation_memory_budget 0.5 needs "
                       "compile_decoder_layers: true"):
        scale.with_levers(scale.selected("2b"), scale.lever_knobs({"RM_BENCH_SCALE_MEMBUDGET": "0.5"}))


def test_a_trl_side_that_cannot_import_is_refused_before_any_run(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    assert scale.trl_side_missing({"RM_BENCH_TRL_LIGER": "0"}) is None, "trl and peft are installed for the tests"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trl" else real(name, *a))
    assert "trl cannot be imported here" in scale.trl_side_missing({"RM_BENCH_TRL_LIGER": "0"})
    assert "set RM_BENCH_TRL=0" in scale.trl_side_missing({})
    assert scale.trl_side_missing({"RM_BENCH_TRL": "0"}) is None
    monkeypatch.setattr(scale.torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("RM_BENCH_TRL_LIGER", "0")
    monkeypatch.delenv("RM_BENCH_TRL", raising=False)
    monkeypatch.setattr(scale, "run_isolated", lambda *a: pytest.fail("a run started before TRL's side was checked"))
    with pytest.raises(SystemExit, match="trl cannot be imported"):
        scale.run(__import__("pathlib").Path("/tmp/rm-scale-trl-missing"))


def test_gc_freeze_knob_runs_both_and_reaches_the_training_config(tmp_path):
    from trainer.config.schema import validate_config

    runs = scale.with_levers(scale.selected("8b-lora64-sleep2-util0.35"),
                             scale.lever_knobs({"RM_BENCH_SCALE_GCFREEZE": "1,0"}))
    assert [r.name for r in runs] == ["8b-lora64-sleep2-util0.35", "8b-lora64-sleep2-util0.35-nofreeze"]
    got = [validate_config(scale.stage2_config(r, tmp_path, tmp_path / "o", "vllm")).training
           .freeze_heap_after_first_step for r in runs]
    assert got == [True, False]
    with pytest.raises(SystemExit, match="RM_BENCH_SCALE_GCFREEZE"):
        scale.lever_knobs({"RM_BENCH_SCALE_GCFREEZE": "on"})
