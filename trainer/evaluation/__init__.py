"""Held-out evaluation: greedy rollouts → strict parse → matching → detection metrics (``metrics.py`` is pure;
``run.py`` drives a model and writes files)."""
