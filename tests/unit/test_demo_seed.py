"""``trainer demo --seed``: one seed sets every draw of a run (training, the tiny model, the synthetic data)."""

from __future__ import annotations

from trainer.config.schema import load_config
from trainer.demo import DEFAULT_CONFIG, apply_seed


def test_one_seed_sets_training_model_and_data():
    cfg = load_config(DEFAULT_CONFIG)
    assert cfg.model.tiny == "vl", "the demo's model reads the pixels"
    apply_seed(cfg, 7)
    assert (cfg.training.seed, cfg.model.tiny_seed, cfg.data.synthetic.seed) == (7, 7, 7)
