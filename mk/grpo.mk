# Summary GRPO (ms-swift): set-up, synthetic data, tests. Included by the top-level Makefile.
#   make grpo-data            synthetic summary dataset under runs/summary_data (both domains + irrelevant rows)
#   make grpo-test            GRPO config/reward/ms-swift-mapping tests and launcher tests
#   make grpo-print CONFIG=configs/summary_1024.yaml   the swift rollout + swift rlhf command lines for a config

.PHONY: grpo-data grpo-test grpo-print

# ms-swift and DeepSpeed come with `make setup` (the `swift` and `deepspeed` extras, locks/cpu-test.txt).
grpo-print: CONFIG ?= configs/summary_1024.yaml

grpo-data: setup
	$(PY) -m trainer.grpo.summary_data runs/summary_data --num-samples 64 --seed 0

grpo-test: setup
	$(PY) -m pytest -q tests/grpo tests/launch

grpo-print: setup
	$(PY) -m trainer launch server --engine swift --config $(CONFIG) --print-command
	$(PY) -m trainer launch learner --config $(CONFIG) --print-command
