"""Importable functions for the raw-torch baselines (workers import them by name)."""


def echo(x):
    return x
