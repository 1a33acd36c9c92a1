"""Benchmark tables (``benchmarks/*.yaml``, ``trainer.bench.table``): every shipped variant validates through the
training schema, variants merge base <- extends <- config with the runner's keys filled, a values file's learner config
can be a variant, and each problem is one line naming the table, the variant and the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.bench.table import BenchTableError, load_table, select, variant_config
from trainer.config.schema import validate_config

REPO = Path(__file__).resolve().parents[2]
TABLES = sorted((REPO / "benchmarks").glob("*.yaml"))


def _table(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "t.yaml"
    path.write_text(text)
    return path


BASE = """
model: tiny
base:
  data: {synthetic: {image_size: 64}}
  training: {max_steps: 2, records_per_step: 4, packing: true, packing_length: 4096, gradient_checkpointing_policy: "off"}
  custom: {extra: {rollout_matching: {rollout_backend: hf, decoding: {max_new_tokens: 16}}}}
fragments:
  long: {custom: {extra: {rollout_matching: {decoding: {max_new_tokens: 32}}}}}
"""


@pytest.mark.parametrize("path", TABLES, ids=lambda p: p.name)
def test_every_shipped_variant_validates(path):
    table = load_table(path)
    for v in table.variants:
        cfg = validate_config(variant_config(table, v, path.parent))
        assert cfg.training.max_steps >= 2, (path.name, v.name)
    assert len({v.name for v in table.variants}) == len(table.variants)


def test_every_published_figure_names_a_variant_of_a_shipped_table():
    """Each record under docs/benchmarks that `bench run` produced says how to reproduce it; the variants it names
    exist, so the command runs (the tables validate above)."""
    commands = [r["command"] for name in ("layouts.json", "scale.json")
                for r in json.loads((REPO / "docs" / "benchmarks" / name).read_text())["records"]]
    assert commands
    for command in commands:
        prefix, _, only = command.partition(" --only ")
        assert prefix.startswith("python -m trainer bench run benchmarks/"), command
        table = load_table(REPO / prefix.split()[-1])
        assert [v.name for v in select(table, only)] == only.split(","), command


def test_the_published_variants_turn_their_levers_on_by_config_keys():
    layouts = load_table(REPO / "benchmarks" / "layouts.yaml")
    where = REPO / "benchmarks"
    (shipped,) = select(layouts, "colocate-2-r128-pixels-auto-compile-recload")
    cfg = validate_config(variant_config(layouts, shipped, where, urls=[]))
    t, v = cfg.training, cfg.rollout_matching.vllm
    assert shipped.learner_gpus == 2 and t.records_per_step == 128 and cfg.rollout_matching.rollout_generate_batch_size == 128
    assert t.checkpointing_policy == "auto" and t.compile_decoder_layers and t.compile_activation_memory_budget == "auto"
    assert v.pixels_during_decode and v.sync.recorded_load and v.mode == "colocate"
    (plain,) = select(layouts, "colocate-1")
    p = validate_config(variant_config(layouts, plain, where))
    assert p.training.checkpointing_policy == "full" and not p.training.compile_decoder_layers
    assert not p.rollout_matching.vllm.pixels_during_decode and not p.rollout_matching.vllm.sync.recorded_load
    (server,) = select(layouts, "3v1-async")
    s = validate_config(variant_config(layouts, server, where, urls=["http://a:1", "http://b:2", "http://c:3"]))
    assert s.rollout_matching.vllm.mode == "server" and s.rollout_matching.vllm.server.async_rollouts.enabled
    assert len(s.rollout_matching.vllm.server.base_urls()) == 3
    scale = load_table(REPO / "benchmarks" / "scale.yaml")
    (lora,) = select(scale, "8b-lora64-levers")
    c = validate_config(variant_config(scale, lora, where))
    assert lora.model == "8b" and c.tuner.train_type == "lora" and c.tuner.lora_rank == 64
    assert c.rollout_matching.vllm.sync.merge_into_engine and c.rollout_matching.vllm.gpu_memory_utilization == 0.35
    assert scale.trl and select(scale, "8b-lora64-levers-no-trl")[0].trl is False


def test_a_variant_merges_base_then_extends_then_config_and_the_runner_fills_its_keys(tmp_path):
    path = _table(tmp_path, BASE + """
variants:
  - name: a
    extends: "#long"
    config: {training: {records_per_step: 8}}
  - name: b
    servers: 2
    config: {custom: {extra: {rollout_matching: {rollout_backend: vllm, vllm: {mode: server}}}}}
""")
    table = load_table(path)
    a = variant_config(table, table.variants[0], tmp_path, model_dir="/m", output_dir="/o")
    assert a["custom"]["extra"]["rollout_matching"]["decoding"]["max_new_tokens"] == 32, "the fragment"
    assert a["custom"]["extra"]["rollout_matching"]["rollout_backend"] == "hf", "the base, kept where not overridden"
    assert a["training"]["records_per_step"] == 8 and a["training"]["max_steps"] == 2
    assert a["model"]["path"] == "/m" and a["training"]["output_dir"] == "/o"
    assert a["data"]["synthetic"]["num_samples"] == 8 * 3, "records per step x (steps + 1)"
    assert table.base["training"]["records_per_step"] == 4, "the base is not changed by a variant"
    b = variant_config(table, table.variants[1], tmp_path, urls=["http://h:1", "http://h:2"])
    assert b["custom"]["extra"]["rollout_matching"]["vllm"]["server"]["servers"] == [
        {"base_url": "http://h:1"}, {"base_url": "http://h:2"}]


def test_a_values_file_s_learner_config_can_be_a_variant(tmp_path):
    (tmp_path / "node.values.yaml").write_text(
        "node: {gpuCount: 4}\nlearner:\n  nprocPerNode: 4\n  config:\n    training: {records_per_step: 16, "
        "compile_decoder_layers: true}\n")
    path = _table(tmp_path, BASE + """
variants:
  - name: shipped
    learner_gpus: 4
    extends: node.values.yaml#learner.config
  - name: shipped-shorter
    extends: node.values.yaml#learner.config
    config: {training: {max_steps: 3}}
""")
    table = load_table(path)
    cfg = validate_config(variant_config(table, table.variants[0], tmp_path))
    assert cfg.training.records_per_step == 16 and cfg.training.compile_decoder_layers
    assert cfg.training.max_steps == 2, "what the values file leaves out comes from the base"
    assert validate_config(variant_config(table, table.variants[1], tmp_path)).training.max_steps == 3
    preset = REPO / "presets" / "colocate-4-2b-full.values.yaml"
    if preset.is_file():  # the shipped preset as a variant of the layouts table
        layouts = load_table(REPO / "benchmarks" / "layouts.yaml")
        (v,) = select(layouts, "colocate-4-preset")
        got = validate_config(variant_config(layouts, v, REPO / "benchmarks"))
        assert got.training.records_per_step == 256 and got.rollout_matching.vllm.sync.recorded_load


def test_unknown_keys_are_one_line_each_naming_the_table_the_variant_and_the_key(tmp_path):
    path = _table(tmp_path, BASE + """
variants:
  - name: good
  - name: typo
    config: {training: {records_per_stepp: 8}}
  - name: placement
    learner_gpu: 2
""")
    with pytest.raises(BenchTableError) as err:
        load_table(path)
    lines = err.value.lines
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"{path}: variant 'placement': learner_gpu: unknown key; known: name, model")
    assert lines[1].startswith(f"{path}: variant 'typo': training.records_per_stepp: unknown key; did you mean "
                               "'records_per_step'?"), lines[1]


def test_every_problem_of_a_table_is_reported_at_once(tmp_path):
    path = _table(tmp_path, BASE + """
variants:
  - name: a
    baseline: nope
  - name: a
  - name: b
    extends: "#missing"
  - name: c
    servers: 1
  - name: d
    extends: nothere.yaml#learner.config
""")
    with pytest.raises(BenchTableError) as err:
        load_table(path)
    text = "\n".join(err.value.lines)
    assert "variant 'a': name: used twice" in text
    assert "variant 'a': baseline: 'nope' is not a variant of this table" in text
    assert "variant 'b': extends: #missing: no fragment 'missing' in this table; its fragments: long" in text
    assert "variant 'c': servers: rollout servers need custom.extra.rollout_matching.vllm.mode: server" in text
    assert "variant 'd': config file not found:" in text and "nothere.yaml" in text


def test_only_picks_variants_in_the_order_named_and_names_unknown_ones(tmp_path):
    table = load_table(_table(tmp_path, BASE + "variants: [{name: a}, {name: b}, {name: c}]\n"))
    assert [v.name for v in select(table, "c,a,c")] == ["c", "a"]
    assert [v.name for v in select(table, None)] == ["a", "b", "c"]
    with pytest.raises(BenchTableError, match="no variant 'z' in this table; its variants: a, b, c"):
        select(table, "a,z")


def test_the_cli_prints_a_bad_table_s_problems_without_a_traceback(tmp_path, capsys):
    from trainer.cli import main

    path = _table(tmp_path, BASE + "variants: [{name: a, config: {training: {bogus: 1}}}]\n")
    assert main(["bench", "run", str(path)]) == 2
    out = capsys.readouterr()
    assert "variant 'a': training.bogus: unknown key" in out.out and "Traceback" not in out.out + out.err
    assert main(["bench", "run", str(tmp_path / "none.yaml")]) == 2
    assert "no such benchmark table" in capsys.readouterr().out
