"""grpo."""
