"""Hyperparameter sweeps: a base job, the job-spec fields to vary, and Optuna's sampler and pruner
deciding which trials run and which stop early (space.py: the fields and values; spec.py: what a
user submits; study.py: the Optuna study in the store's database)."""
