"""Requests the server must not trust: refused before scheduling (:mod:`.validation`)."""

from __future__ import annotations

from .validation import VALIDATION_HOOKS, register_validation_hooks

SERVING_HOOKS = VALIDATION_HOOKS


def register_serving_hooks() -> None:
    register_validation_hooks()
