"""Requests the server must not trust: refused before scheduling (:mod:`.validation`), a request
whose constraints leave no token failing alone (:mod:`.dead_end_sampling`), and a forward that
fails contained to its own batch (:mod:`.containment`)."""

from __future__ import annotations

from .containment import CONTAINMENT_HOOKS, register_containment_hooks
from .dead_end_sampling import DEAD_END_HOOKS, register_dead_end_hooks
from .validation import VALIDATION_HOOKS, register_validation_hooks

SERVING_HOOKS = (*VALIDATION_HOOKS, *DEAD_END_HOOKS, *CONTAINMENT_HOOKS)


def register_serving_hooks() -> None:
    register_validation_hooks()
    register_dead_end_hooks()
    register_containment_hooks()
