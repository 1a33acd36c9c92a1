"""vLLM (CPU) loads a checkpoint ``model prepare`` wrote from a tiny stock one: its vocabulary has the coord tokens,
a prompt holding them is served as encoded, and coord tokens it generates decode to their own text."""

from __future__ import annotations

import pytest

from trainer.data.output_format import all_coord_tokens

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def prepared_dir(tmp_path_factory):
    from trainer.modeling.fixtures import save_tiny_model
    from trainer.modeling.prepare import prepare_checkpoint

    root = tmp_path_factory.mktemp("from-stock")
    stock = save_tiny_model(root / "stock", "text", seed=3, stock=True, vocab_rows=1024)
    prepare_checkpoint(stock, root / "prepared")
    return root / "prepared"


def test_vllm_serves_the_prepared_checkpoint_with_coord_tokens(prepared_dir, cpu_engine_kwargs, chat_requests):
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from trainer.modeling.coord_vocab import stop_token_ids
    from trainer.rollout.types import DecodingParams, check_prompt_alignment
    from trainer.rollout.vllm_colocate import VllmColocateEngine

    tok = AutoTokenizer.from_pretrained(prepared_dir)
    coord_ids = tok.convert_tokens_to_ids(all_coord_tokens())
    engine = VllmColocateEngine(prepared_dir, sorted(stop_token_ids(tok)), max_model_len=256,
                                gpu_memory_utilization=0.3, dtype="float32", engine_kwargs=cpu_engine_kwargs)
    try:
        llm = engine.vllm.llm
        assert llm.llm_engine.model_config.get_vocab_size() == len(tok) == 1800
        served = llm.get_tokenizer()
        assert served.convert_tokens_to_ids(all_coord_tokens()) == coord_ids
        reqs = chat_requests(tok, ["red circle <|coord_12|> <|coord_999|>", "two blue squares"])
        assert 812 in reqs[0].prompt_token_ids and 1799 in reqs[0].prompt_token_ids
        got = engine.generate(reqs, DecodingParams(max_new_tokens=8))
        check_prompt_alignment(reqs, got)
        assert all(len(r.response_token_ids) > 0 for r in got)
        out = llm.generate([{"prompt_token_ids": list(reqs[1].prompt_token_ids)}],
                           SamplingParams(max_tokens=4, temperature=0.0, allowed_token_ids=coord_ids))[0].outputs[0]
        assert len(out.token_ids) == 4 and all(t in set(coord_ids) for t in out.token_ids)
        assert out.text == "".join(f"<|coord_{t - coord_ids[0]}|>" for t in out.token_ids)
    finally:
        engine.close()
