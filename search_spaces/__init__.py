"""Declarative search spaces, one module per kernel (importable without Optuna or a GPU)."""
