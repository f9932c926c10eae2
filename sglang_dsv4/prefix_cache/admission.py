"""SGLang's admission and decode checks, extended to the V4 window slots.

SGLang admits a request when its token slots fit (``PrefillAdder.add_one_req``) and retracts
decoding requests when the next step's do not (``ScheduleBatch.check_decode_mem``, which
``retract_decode`` asks again after each request it retracts). A V4 forward also needs
window slots of its own: the last ``sliding_window + 1`` tokens of every request in it. Both
checks here ask for the count that reserving the forwards' rows takes
(:meth:`~sglang_dsv4.memory_pool.request_tables.RequestTables.window_slots_for_forward`; a decode step of a
row whose window is full recycles its oldest slot:
:meth:`~sglang_dsv4.prefix_cache.manager.CacheManager.window_slots_for_decode`), freed
the way reserving frees it (rows' slots beyond what forwards read, the checkpoints worth least,
snapshots not taken yet), and then answer as SGLang does when its token pool runs out: the
request stays queued (``NO_TOKEN``), or decoding requests are retracted, and the
scheduler keeps running. Checkpoints, being optional, never hold a request back: the pool skips
them instead (:class:`~.checkpoints.Checkpoints`).
"""

from __future__ import annotations

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

_ADMISSION = "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req"
_DECODE_MEMORY = "sglang.srt.managers.schedule_batch.ScheduleBatch.check_decode_mem"
ADMISSION_HOOKS = (_ADMISSION, _DECODE_MEMORY)


def register_admission_hooks() -> None:
    HookRegistry.register(_ADMISSION, _admit_within_window_slots, HookType.AROUND)
    HookRegistry.register(_DECODE_MEMORY, _decode_within_window_slots, HookType.AROUND)


def _admit_within_window_slots(add_one_req, adder, req, *args, **kwargs):
    """Admit ``req`` only if the window slots of the prefill batch built so far and its own fit."""
    from sglang.srt.managers.schedule_policy import AddReqResult

    from .tree import V4RadixCache

    tree = adder.tree_cache
    if isinstance(tree, V4RadixCache):
        batch = [*adder.can_run_list, req]
        need = sum(tree.window_slots_for_forward(len(r.full_untruncated_fill_ids) - r.prefix_len) for r in batch)
        if not tree.room_for_windows(need, keep=req.last_node):
            tree.note_held_back("admissions_deferred")
            return AddReqResult.NO_TOKEN
    return add_one_req(adder, req, *args, **kwargs)


def _decode_within_window_slots(check_decode_mem, batch, selected_indices=None):
    """The next decode step fits SGLang's token pool and the window slots it takes from what is free (a request
    whose window is full recycles its oldest slot under ``per_request``; under speculation one per token of a
    verify forward)."""
    from .tree import V4RadixCache

    if not check_decode_mem(batch, selected_indices):
        return False
    tree = batch.tree_cache
    if not isinstance(tree, V4RadixCache):
        return True
    reqs = batch.reqs if selected_indices is None else [batch.reqs[i] for i in selected_indices]
    tokens = max(1, tree.manager.storage.verify_tokens)
    if tree.room_for_windows(tree.window_slots_for_decode([req.kv.req_pool_idx for req in reqs], tokens)):
        return True
    tree.note_held_back("decode_retractions")
    return False
