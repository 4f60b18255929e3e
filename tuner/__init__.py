"""The offline tuner: Optuna studies per (kernel, key, GPU) feeding the config DB."""
