"""``python -m trainer model prepare``: a random tiny stock Qwen3-VL (and an untied Qwen3) without coord tokens is
prepared, loads with transformers at the right sizes with the coord rows initialised as documented, a second run
changes nothing, what it cannot handle is refused in one line (exit 2), and train / eval on a stock checkpoint say
to run prepare. Also ``stage1.learning_rate: auto`` / ``stage1.bf16: auto``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

from tests.cli_runs import small_config, torch_process_state_kept
from trainer.cli import main
from trainer.config.schema import Stage1Config
from trainer.data.output_format import all_coord_tokens
from trainer.modeling.fixtures import save_tiny_model, tiny_tokenizer
from trainer.modeling.prepare import RECORD, place_weights, prepare_checkpoint

SPARE_ROWS = 1024  # the stock tokenizer has 800 tokens: coord ids 800..1023 land on rows the stock model already had


@pytest.fixture(scope="module")
def stock_vl(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("stock") / "vl", "vl", seed=1, stock=True, vocab_rows=SPARE_ROWS)


@pytest.fixture(scope="module")
def prepared_vl(stock_vl, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "vl"
    prepare_checkpoint(stock_vl, out)
    return out


@pytest.fixture(scope="module")
def stock_untied(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("stock") / "untied", "text", seed=2, stock=True, tied=False)


def _stock_embeddings(model_dir: Path) -> torch.Tensor:
    sd = load_file(str(model_dir / "model.safetensors"))
    return next(v for k, v in sd.items() if k.endswith("embed_tokens.weight"))


def _expected_number_rows(stock_weight: torch.Tensor, stock_tok) -> torch.Tensor:
    rows = []
    for k in range(1000):
        ids = stock_tok(str(k), add_special_tokens=False)["input_ids"]
        rows.append(place_weights(len(ids)) @ stock_weight[ids].float())
    return torch.stack(rows)


def test_prepared_vl_loads_with_transformers_at_the_right_sizes(stock_vl, prepared_vl):
    tok = AutoTokenizer.from_pretrained(prepared_vl)
    model = AutoModelForImageTextToText.from_pretrained(prepared_vl, dtype=torch.float32)
    assert len(tok) == 800 + 1000
    ids = tok.convert_tokens_to_ids(all_coord_tokens())
    assert ids == list(range(800, 1800))
    assert tok("<|coord_7|><|coord_999|>", add_special_tokens=False)["input_ids"] == [807, 1799]
    assert model.get_input_embeddings().weight.shape[0] == 1800
    assert model.get_output_embeddings().weight.shape[0] == 1800
    assert AutoConfig.from_pretrained(prepared_vl).text_config.vocab_size == 1800
    for name in ("preprocessor_config.json", "chat_template.jinja", "generation_config.json"):
        assert (prepared_vl / name).is_file(), name
    assert tok.chat_template == AutoTokenizer.from_pretrained(stock_vl).chat_template
    record = json.loads((prepared_vl / RECORD).read_text())
    assert record["tokens_added"] == 1000 and record["init"] == "number" and record["first_coord_id"] == 800
    assert record["rows_before"] == SPARE_ROWS and record["rows_after"] == 1800
    assert record["source"] == str(stock_vl.resolve()) and record["model_type"] == "qwen3_vl"


def test_prepared_tokenizer_encodes_like_the_embedded_one(prepared_vl):
    """The stock tiny tokenizer plus the appended coord tokens is the embedded tokenizer, id for id."""
    answer = '{"object_1": {"desc": "red square", "bbox_2d": [<|coord_12|>, <|coord_40|>, <|coord_77|>, <|coord_90|>]}}'
    assert (AutoTokenizer.from_pretrained(prepared_vl)(answer, add_special_tokens=False)["input_ids"]
            == tiny_tokenizer()(answer, add_special_tokens=False)["input_ids"])


def test_number_init_writes_every_coord_row_and_keeps_the_stock_rows(stock_vl, prepared_vl):
    stock = _stock_embeddings(stock_vl)
    got = _stock_embeddings(prepared_vl)
    stock_tok = AutoTokenizer.from_pretrained(stock_vl)
    assert torch.equal(got[:800], stock[:800])
    want = _expected_number_rows(stock, stock_tok)
    torch.testing.assert_close(got[800:1800], want)
    assert not torch.equal(got[800:SPARE_ROWS], stock[800:SPARE_ROWS]), "the spare stock rows were left as they were"
    assert not torch.allclose(got[800 + 12], got[800 + 21]), "12 and 21 must not share a row"


def test_untied_head_rows_come_from_the_head(stock_untied, tmp_path):
    out = tmp_path / "prepared"
    result = prepare_checkpoint(stock_untied, out)
    assert not result.tied_embeddings
    stock_sd, sd = load_file(str(stock_untied / "model.safetensors")), load_file(str(out / "model.safetensors"))
    stock_tok = AutoTokenizer.from_pretrained(stock_untied)
    torch.testing.assert_close(sd["lm_head.weight"][800:], _expected_number_rows(stock_sd["lm_head.weight"], stock_tok))
    torch.testing.assert_close(sd["model.embed_tokens.weight"][800:],
                               _expected_number_rows(stock_sd["model.embed_tokens.weight"], stock_tok))
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert not model.config.tie_word_embeddings
    assert model.lm_head.weight.shape[0] == model.model.embed_tokens.weight.shape[0] == 1800


def test_mean_init_and_padding(stock_untied, tmp_path):
    out = tmp_path / "mean"
    result = prepare_checkpoint(stock_untied, out, init="mean", pad_to_multiple_of=64)
    assert result.rows_after == 1856 and result.init == "mean"
    stock = load_file(str(stock_untied / "model.safetensors"))["model.embed_tokens.weight"]
    got = load_file(str(out / "model.safetensors"))["model.embed_tokens.weight"]
    torch.testing.assert_close(got[800:], stock.mean(0).expand(1056, -1))
    assert AutoConfig.from_pretrained(out).vocab_size == 1856


def test_second_run_and_prepared_source_change_nothing(stock_vl, prepared_vl, tmp_path, capsys):
    before = {p.name: p.read_bytes() for p in prepared_vl.iterdir()}
    assert main(["model", "prepare", "--from", str(stock_vl), "--out", str(prepared_vl)]) == 0
    assert "already prepared" in capsys.readouterr().out
    assert {p.name: p.read_bytes() for p in prepared_vl.iterdir()} == before
    again = tmp_path / "again"
    assert main(["model", "prepare", "--from", str(prepared_vl), "--out", str(again)]) == 0
    assert "already prepared" in capsys.readouterr().out
    for name, data in before.items():
        if name != RECORD:
            assert (again / name).read_bytes() == data, name
    record = json.loads((again / RECORD).read_text())
    assert record["already_prepared"] and record["tokens_added"] == 0 and record["previous"]["init"] == "number"


def _refused(argv, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err


def test_refusals_are_one_line_with_exit_2(stock_vl, prepared_vl, tmp_path, capsys):
    out = str(tmp_path / "out")
    assert "no such directory" in _refused(["model", "prepare", "--from", str(tmp_path / "nope"), "--out", out], capsys)
    no_tok = tmp_path / "no-tok"
    no_tok.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(stock_vl / name, no_tok / name)
    assert "no tokenizer" in _refused(["model", "prepare", "--from", str(no_tok), "--out", out], capsys)
    unknown = tmp_path / "unknown"
    shutil.copytree(no_tok, unknown)
    (unknown / "config.json").write_text(json.dumps({"model_type": "not_a_model"}))
    assert "unknown architecture" in _refused(["model", "prepare", "--from", str(unknown), "--out", out], capsys)
    partial = tmp_path / "partial"
    shutil.copytree(stock_vl, partial)
    tok = AutoTokenizer.from_pretrained(stock_vl)
    tok.add_tokens(all_coord_tokens()[:10])
    tok.save_pretrained(partial)
    assert "partial (10 of 1000)" in _refused(["model", "prepare", "--from", str(partial), "--out", out], capsys)
    no_rows = tmp_path / "no-rows"
    shutil.copytree(stock_vl, no_rows)
    shutil.copy(prepared_vl / "tokenizer.json", no_rows / "tokenizer.json")
    shutil.copy(prepared_vl / "tokenizer_config.json", no_rows / "tokenizer_config.json")
    cfg = json.loads((no_rows / "config.json").read_text())
    assert cfg["text_config"]["vocab_size"] == SPARE_ROWS
    assert "embedding rows" in _refused(["model", "prepare", "--from", str(no_rows), "--out", out], capsys)
    assert "not this preparation" in _refused(["model", "prepare", "--from", str(stock_vl), "--out",
                                               str(no_rows)], capsys)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["train", "eval", "demo"])
def test_train_and_eval_on_a_stock_checkpoint_say_to_prepare_it(stock_vl, tmp_path, capsys, command):
    with torch_process_state_kept():
        assert main([command, "--config", str(small_config(tmp_path, stock_vl, "stock.yaml"))]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: model.path ") and "lacks 1000 of the 1000 coord tokens" in last
    assert f"python -m trainer model prepare --from {stock_vl} --out" in last


def test_stage1_learning_rate_auto_by_size_and_tuner():
    s1 = Stage1Config()
    assert s1.learning_rate == "auto" and s1.bf16 == "auto"
    assert s1.resolved_learning_rate(2_000_000, "full") == 3e-3
    assert s1.resolved_learning_rate(2_100_000_000, "full") == 2e-5
    assert s1.resolved_learning_rate(2_100_000_000, "lora") == 2e-4
    assert s1.resolved_learning_rate(4_400_000_000, "full") == 1e-5
    assert s1.resolved_learning_rate(8_700_000_000, "dora") == 1e-4
    assert s1.resolved_learning_rate(32_000_000_000, "full") == 5e-6
    assert Stage1Config(learning_rate=1e-3).resolved_learning_rate(8_700_000_000, "full") == 1e-3
    assert s1.resolved_bf16(False, "bfloat16") and s1.resolved_bf16(True, "float32")
    assert not s1.resolved_bf16(False, "float32")
    assert not Stage1Config(bf16=False).resolved_bf16(True, "bfloat16")
    with pytest.raises(ValueError):
        Stage1Config(learning_rate="fast")


def test_demo_config_keeps_its_explicit_stage1_values():
    import yaml

    from trainer.config.schema import validate_config

    raw = yaml.safe_load((Path(__file__).parents[2] / "configs" / "demo.yaml").read_text())
    demo = validate_config(raw)
    assert demo.stage1.learning_rate == float(raw["stage1"]["learning_rate"]) != Stage1Config().learning_rate


def test_the_trainer_loads_the_prepared_vl_checkpoint(prepared_vl, tmp_path):
    from trainer.config.schema import ModelConfig
    from trainer.modeling.coord_vocab import build_parse_vocab
    from trainer.modeling.loading import load_model

    loaded = load_model(ModelConfig(path=str(prepared_vl)), tmp_path)
    assert loaded.multimodal and loaded.model_type == "qwen3_vl" and loaded.image_token_id is not None
    vocab = build_parse_vocab(loaded.tokenizer)
    assert vocab.coord_bin_by_id[800] == 0 and vocab.coord_bin_by_id[1799] == 999


def test_stage1_auto_rate_counts_partitioned_parameters_at_full_size():
    from trainer.sft.run import parameter_count

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2, bias=False))
    assert parameter_count(model) == 4 * 3 + 3 + 3 * 2
    model[1].weight.ds_numel = 8_000_000_000  # a ZeRO-3 partitioned tensor holds an empty shard on this rank
    assert Stage1Config().resolved_learning_rate(parameter_count(model), "full") == 1e-5


def test_an_adapter_refuses_coord_rows_it_could_never_tell_apart(stock_untied, tmp_path):
    from trainer.config.schema import ModelConfig, TunerConfig
    from trainer.modeling.loading import CheckpointNotPrepared, check_adapter_can_learn_coords, load_model

    prepare_checkpoint(stock_untied, tmp_path / "mean", init="mean")
    prepare_checkpoint(stock_untied, tmp_path / "number")
    mean = load_model(ModelConfig(path=str(tmp_path / "mean")), tmp_path)
    with pytest.raises(CheckpointNotPrepared, match=r"share one input embedding row .* prepare with --init number"):
        check_adapter_can_learn_coords(mean, TunerConfig(train_type="lora"))
    check_adapter_can_learn_coords(mean, TunerConfig(train_type="full"))
    check_adapter_can_learn_coords(mean, TunerConfig(train_type="lora", target_modules=["q_proj", "lm_head"]))
    check_adapter_can_learn_coords(load_model(ModelConfig(path=str(tmp_path / "number")), tmp_path),
                                   TunerConfig(train_type="dora"))
