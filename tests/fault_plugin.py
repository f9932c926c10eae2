"""A test-only SGLang plugin that makes a forward raise for marked prompts.

Never installed: ``tests/test_containment.py`` gives a server this module on its
``PYTHONPATH`` together with an entry point of its own (group ``sglang.srt.plugins``),
so no switch in the product turns faults on.

A prompt whose last token is a marker id fails on purpose:

- ``PREFILL_FAULT``: the model's forward over its prompt raises;
- ``SAMPLING_FAULT``: sampling its first token raises (for a grammar-constrained request the
  overlap scheduler runs that sampling after the forward, in ``launch_batch_sample_if_needed``);
- ``DECODE_FAULT``: its ``DECODE_FAULT_STEP``-th decode forward raises;
- ``TRANSFER_FAULT``: on a prefill instance of a disaggregated pair, sending its state to the decode instance
  fails (the Mooncake manager's state send returns an error, as a failed ``batch_transfer_sync`` does);
- ``TRANSFER_HOLD``: on a prefill instance, its state send is held before any byte moves, as a transfer that does
  not progress: until its room fails (an abort on either side, the decode instance's waiting timeout), when it
  returns having sent nothing; or until a file ``release`` appears in the folder ``FAULT_SIGNALS`` names, or
  ``HOLD_LIMIT_S`` passes, when it sends. While held, the file ``held`` is in that folder (the test's cue to act).

Only the prompt's last token is looked at: a prefix cache never matches it, so every
prefill of a marked prompt sees the marker.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

PREFILL_FAULT, SAMPLING_FAULT, DECODE_FAULT, TRANSFER_FAULT, TRANSFER_HOLD = 1021, 1020, 1019, 1018, 1017
DECODE_FAULT_STEP = 3
HOLD_LIMIT_S = 120.0
SIGNALS = "FAULT_SIGNALS"

_MODEL_FORWARD = "sglang_dsv4.model.sglang_model.DeepseekV4ForCausalLM.forward"
_SAMPLE = "sglang.srt.model_executor.model_runner.ModelRunner.sample"
_STATE_SEND = "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.maybe_send_extra"

# Request row (req_pool_idx) of a DECODE_FAULT prompt -> decode forwards left before the fault.
_decode_steps_left: dict[int, int] = {}
# Request rows of TRANSFER_FAULT prompts whose state send is to fail, and of TRANSFER_HOLD prompts whose send is held.
_failing_sends: set[int] = set()
_held_sends: set[int] = set()


class InjectedFault(RuntimeError):
    pass


def register() -> None:
    HookRegistry.register(_MODEL_FORWARD, _faulty_forward, HookType.AROUND)
    HookRegistry.register(_SAMPLE, _faulty_sample, HookType.AROUND)
    HookRegistry.register(_STATE_SEND, _faulty_state_send, HookType.AROUND)


def _faulty_forward(forward, model, input_ids, positions, forward_batch, *args, **kwargs):
    if forward_batch.forward_mode.is_extend():
        markers = _last_prompt_tokens(forward_batch)
        for row, last in markers.items():
            _decode_steps_left.pop(row, None)
            if last == DECODE_FAULT:
                _decode_steps_left[row] = DECODE_FAULT_STEP
        for row, last in markers.items():  # a row's last extend decides (a send never reached leaves none behind)
            for marker, rows in ((TRANSFER_FAULT, _failing_sends), (TRANSFER_HOLD, _held_sends)):
                (rows.add if last == marker else rows.discard)(row)
        if PREFILL_FAULT in markers.values():
            raise InjectedFault("injected prefill fault")
    elif forward_batch.forward_mode.is_decode():
        for row in forward_batch.req_pool_indices.tolist():
            if row in _decode_steps_left:
                _decode_steps_left[row] -= 1
                if _decode_steps_left[row] == 0:
                    del _decode_steps_left[row]
                    raise InjectedFault("injected decode fault")
    return forward(model, input_ids, positions, forward_batch, *args, **kwargs)


def _faulty_sample(sample, runner, logits_output, forward_batch, *args, **kwargs):
    if forward_batch.forward_mode.is_extend() and SAMPLING_FAULT in _last_prompt_tokens(forward_batch).values():
        raise InjectedFault("injected sampling fault")
    return sample(runner, logits_output, forward_batch, *args, **kwargs)


def _last_prompt_tokens(forward_batch) -> dict[int, int]:
    """Request row -> the last token of its segment of this extend."""
    ids = forward_batch.input_ids.tolist()
    rows = forward_batch.req_pool_indices.tolist()
    last, end = {}, 0
    for row, length in zip(rows, forward_batch.extend_seq_lens_cpu, strict=True):
        end += length
        last[row] = ids[end - 1]
    return last


def _faulty_state_send(send, manager, req, state_indices, *args, **kwargs) -> int:
    """The state send of a TRANSFER_FAULT prompt's request row fails, a TRANSFER_HOLD prompt's is held (the row is
    the V4 state group's one index)."""
    groups = getattr(manager.kv_args, "dsv4_groups", {})
    rows = [int(state_indices[position][0]) for position, name in groups.items() if name == "state"]
    if rows and rows[0] in _failing_sends:
        _failing_sends.discard(rows[0])
        return -1
    if rows and rows[0] in _held_sends:
        _held_sends.discard(rows[0])
        if not _held_until_released(manager, req.room):
            return 0  # the room failed while held: nothing was sent
    return send(manager, req, state_indices, *args, **kwargs)


def _held_until_released(manager, room: int) -> bool:
    """Hold until the room fails (False) or the test releases it or the limit passes (True)."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    signals = Path(os.environ.get(SIGNALS, "/nonexistent"))
    if signals.is_dir():
        (signals / "held").touch()
    deadline = time.monotonic() + HOLD_LIMIT_S
    try:
        while time.monotonic() < deadline and not (signals / "release").exists():
            if manager.request_status.get(room, KVPoll.Failed) == KVPoll.Failed:
                return False
            time.sleep(0.1)
        return True
    finally:
        (signals / "held").unlink(missing_ok=True)
