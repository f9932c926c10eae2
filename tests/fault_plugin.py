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
  fails (the Mooncake manager's state send returns an error, as a failed ``batch_transfer_sync`` does).

Only the prompt's last token is looked at: a prefix cache never matches it, so every
prefill of a marked prompt sees the marker.
"""

from __future__ import annotations

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

PREFILL_FAULT, SAMPLING_FAULT, DECODE_FAULT, TRANSFER_FAULT = 1021, 1020, 1019, 1018
DECODE_FAULT_STEP = 3

_MODEL_FORWARD = "sglang_dsv4.model.sglang_model.DeepseekV4ForCausalLM.forward"
_SAMPLE = "sglang.srt.model_executor.model_runner.ModelRunner.sample"
_STATE_SEND = "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.maybe_send_extra"

# Request row (req_pool_idx) of a DECODE_FAULT prompt -> decode forwards left before the fault.
_decode_steps_left: dict[int, int] = {}
# Request rows of TRANSFER_FAULT prompts whose state send is to fail.
_failing_sends: set[int] = set()


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
        _failing_sends.update(row for row, last in markers.items() if last == TRANSFER_FAULT)
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
    """The state send of a TRANSFER_FAULT prompt's request row fails (the row is the V4 state group's one index)."""
    groups = getattr(manager.kv_args, "dsv4_groups", {})
    rows = [int(state_indices[position][0]) for position, name in groups.items() if name == "state"]
    if rows and rows[0] in _failing_sends:
        _failing_sends.discard(rows[0])
        return -1
    return send(manager, req, state_indices, *args, **kwargs)
