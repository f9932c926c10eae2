"""What a request row keeps of the window slots it wrote: one type per policy, chosen once.

``per_request`` keeps only what a forward or a checkpoint can still read (the last window plus
one token, and the window behind each snapshot position); ``all_committed`` keeps every slot
the request wrote until it is freed, so its final checkpoint commits them all (upstream's
behaviour), as far as the window slots allow (the cache manager, :mod:`.manager`, gives them
back first when forwards need room).
"""

from __future__ import annotations

from typing import Protocol

from ..memory_pool.request_tables import RequestTables


class CacheManager(Protocol):
    """What a policy asks of the cache manager (:class:`~.manager.CacheManager`)."""

    tables: RequestTables

    def hold_optional_window(self, row: int, first: int, last: int) -> bool:
        """Slots for the row's positions ``first .. last - 1`` if room can be made for all of them."""


class WindowPolicy(Protocol):
    name: str
    # Whether a finished request's checkpoint keeps every window slot it holds.
    commits_every_slot: bool
    # Whether checkpoints a later turn resumed past stay until memory runs short (else they go at once).
    keeps_superseded: bool
    # Whether a decode step's reservation may be batched over rows (CacheManager.steps_plainly): the policy
    # does, for one token, only what RequestTables.step_each does (per_request: trim_to_forward; all_committed:
    # nothing, the token's own slot being the only one it would hold).
    plain_decode_steps: bool

    def before_reserve(self, manager: CacheManager, row: int, start: int) -> None:
        """Before the row's forward from ``start`` takes its slots."""

    def after_reserve(self, manager: CacheManager, row: int, start: int, target: int) -> None:
        """After the forward of ``start .. target - 1`` has what it cannot run without."""


class PerRequest:
    name = "per_request"
    commits_every_slot = False
    keeps_superseded = False
    plain_decode_steps = True

    def before_reserve(self, manager: CacheManager, row: int, start: int) -> None:
        manager.tables.trim_to_forward(row, start)

    def after_reserve(self, manager: CacheManager, row: int, start: int, target: int) -> None:
        pass


class AllCommitted:
    name = "all_committed"
    commits_every_slot = True
    keeps_superseded = True
    plain_decode_steps = True

    def before_reserve(self, manager: CacheManager, row: int, start: int) -> None:
        pass

    def after_reserve(self, manager: CacheManager, row: int, start: int, target: int) -> None:
        manager.hold_optional_window(row, start, target)  # as far as the slots allow: else what per_request keeps


PER_REQUEST, ALL_COMMITTED = PerRequest(), AllCommitted()
WINDOW_POLICY_OF = {policy.name: policy for policy in (PER_REQUEST, ALL_COMMITTED)}
