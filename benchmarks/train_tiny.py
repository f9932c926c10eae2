"""Train the shipped tiny DeepSeek-V4 (``sglang_dsv4/checkpoints/tiny``) on text a coding agent sees.

    python benchmarks/train_tiny.py --sessions ../shared/data/agentic_trajectories.jsonl.gz

Seeded and single-threaded (``torch.set_num_threads(1)``; the host is shared). The corpus:

* the recorded agent sessions rendered through the tiny chat template (V4's format) with the bash tool they
  call defined: system prompts, tasks, replies, DSML tool calls, shell output in tool results; every tenth
  session is held out;
* Python sources: the installed ``sglang`` package's ``.py`` files in path order up to ``--python-mb``, every
  tenth file held out;
* the sessions' tool calls as OpenAI-style JSON objects, one a line.

The tokenizer (byte-level BPE, the tiny config's 1,024 ids) is trained on the training split first. The model
starts from the deterministic random builder (:func:`sglang_dsv4.tiny.random_model`, the output head rescaled
to a trainable size) and trains with AdamW on random windows of ``--context`` tokens. What learns what:

* every weight of the network learns from next-token cross-entropy, except the lightning indexers (the top-k
  is a selection, not differentiable) and what the real model does not train by gradient either: the hash
  layers' ``tid2eid`` tables and the gated layers' routing biases stay as the builder drew them;
* each indexer learns from its own loss, as DeepSeek-V3.2 trains its lightning indexer: the KL divergence
  from the main attention's distribution over the compressed entries (summed over heads, detached) to the
  softmax of the indexer's scores, on detached inputs, so the indexer follows what attention reads.

Writes the checkpoint (release tensor names, through :func:`sglang_dsv4.model.loader.release_state_dict`), a
loss curve PNG and a JSON record (steps, wall time, held-out perplexity of the trained and the random
checkpoint).

Then the multi-token-prediction layer (``mtp.0.*``):

    python benchmarks/train_tiny.py --mtp

trains only it, on the checkpoint at ``--out`` with every main weight frozen (the main tensors are written
back bit for bit): from the builder's random MTP weights, next-next-token cross-entropy of the MTP layer
reading the frozen target's streams of each token with the true next token, on the same corpus (tokenized
with the checkpoint's own tokenizer), AdamW on random windows. Its record (``train_tiny_mtp.json``) holds the
curve: training loss, and on held-out windows the MTP layer's loss and how often its top-1 is the true token.
With ``--mtp --mtp-from-checkpoint`` the MTP layer starts from the checkpoint's own ``mtp.*`` weights instead
of the builder's random ones (for a main network fine-tuned after its MTP layer was trained).

Between the two, the replies (what ``dsv4 demo``'s agent needs: its tool calls must parse):

    python benchmarks/train_tiny.py --replies

fine-tunes the main weights of the checkpoint at ``--out`` (its tokenizer and MTP layer kept as they are) on
the same training sessions, each window ending where one of the sessions' assistant replies ends (its
``<｜end▁of▁sentence｜>``), so the window holds a whole reply and the history before it (the session's head,
its system prompt and tool definitions, first, then the history's tail, as a harness trims a long history).
The loss is a weighted next-token cross-entropy: weight ``--reply-weight`` on the reply's tokens (from the
token after ``<｜Assistant｜></think>`` through its end-of-sentence), ``--call-weight`` on its DSML tool-call
block (from the ``<`` before its first ``｜DSML｜`` on), and ``--context-weight`` on every other token (the
history, so the network keeps modelling it); the indexers keep learning from their KL loss as above. Its
record (``results/train_tiny_replies.json``; with ``--continues RECORD``, the record of the ``--replies`` run
that wrote ``--out`` is kept in it) holds the curve and, on held-out sessions, the loss on reply tokens
before and after, and the held-out perplexity as the main run measures it. Run ``--mtp
--mtp-from-checkpoint`` after it: the MTP layer reads the main network's streams, which changed.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import random
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # the tokenizer trainer: one core, like the model

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import sglang
from sglang_dsv4.agentperf.trajectory import SESSION_TOOLS
from sglang_dsv4.model import load_model
from sglang_dsv4.model.attention import Attention
from sglang_dsv4.model.loader import release_state_dict
from sglang_dsv4.model.network import DeepseekV4
from sglang_dsv4.tiny import TINY_CONFIG, random_model, train_tokenizer

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "sglang_dsv4" / "checkpoints" / "tiny"

HELD_OUT_EVERY = 10
TRAIN_HEAD_STD = 0.02


def session_messages(row: dict[str, Any]) -> list[dict[str, Any]]:
    """A recorded session as the chat template takes it: known roles, tool-call arguments parsed."""
    messages = []
    for message in row["messages"]:
        if message["role"] not in ("system", "user", "assistant", "tool"):
            continue
        message = {"role": message["role"], "content": message.get("content") or ""} | (
            {"tool_calls": [_parsed_call(call) for call in message["tool_calls"]]} if message.get("tool_calls") else {}
        )
        messages.append(message)
    return messages


def _parsed_call(call: dict[str, Any]) -> dict[str, Any]:
    try:
        arguments = json.loads(call["function"]["arguments"])
    except json.JSONDecodeError:
        arguments = {"command": call["function"]["arguments"]}
    if not isinstance(arguments, dict):
        arguments = {"command": json.dumps(arguments)}
    return {**call, "function": {"name": call["function"]["name"], "arguments": arguments}}


def corpus(sessions: Path, python_mb: float, template) -> tuple[list[str], list[str]]:
    """``(train, held_out)`` documents."""
    with gzip.open(sessions, "rt", encoding="utf-8") as lines:
        rows = [json.loads(line) for line in lines if line.strip()]
    train: list[str] = []
    held_out: list[str] = []
    for index, row in enumerate(rows):
        messages = session_messages(row)
        rendered = template(messages, list(SESSION_TOOLS))
        calls = [
            json.dumps({"name": call["function"]["name"], "arguments": call["function"]["arguments"]})
            for message in messages
            for call in message.get("tool_calls", [])
        ]
        split = held_out if index % HELD_OUT_EVERY == 0 else train
        split += [rendered, "\n".join(calls)]
    sources = Path(sglang.__file__).parent
    budget = int(python_mb * 1e6)
    for index, path in enumerate(sorted(sources.rglob("*.py"))):
        if budget <= 0:
            break
        text = path.read_text(encoding="utf-8", errors="replace")
        budget -= len(text)
        (held_out if index % HELD_OUT_EVERY == 0 else train).append(text)
    return train, held_out


def token_stream(tokenizer, documents: list[str]) -> torch.Tensor:
    """The documents' ids, each after ``bos`` (rendered sessions already start with it), concatenated."""
    ids: list[int] = []
    bos = tokenizer.bos_token_id
    for document in documents:
        encoded = tokenizer.encode(document, add_special_tokens=False)
        ids += encoded if encoded[:1] == [bos] else [bos, *encoded]
    return torch.tensor(ids, dtype=torch.long)


def windows(stream: torch.Tensor, context: int, count: int, rng: random.Random) -> Iterator[torch.Tensor]:
    for _ in range(count):
        start = rng.randrange(0, stream.numel() - context - 1)
        yield stream[start : start + context + 1]


class IndexerDistillation:
    """Records each CSA layer's queries and indexer inputs in a forward, for the indexer's KL loss."""

    def __init__(self, model: DeepseekV4):
        self.layers = [block.attn for block in model.layers if block.attn.indexer is not None]
        self.records: dict[int, dict[str, torch.Tensor]] = {}
        for attn in self.layers:
            self._wrap(attn)

    def _wrap(self, attn: Attention) -> None:
        record = self.records.setdefault(id(attn), {})
        select, attend = attn.indexer.select, attn._attend

        def recording_select(x, q_residual, rope, state, visible):
            record.update(x=x, q_residual=q_residual, rope=rope, visible=visible)
            return select(x, q_residual, rope, state, visible)

        def recording_attend(q, keys, visible):
            record.update(q=q, entries=keys[keys.shape[0] - record["visible"].shape[1] :])
            return attend(q, keys, visible)

        attn.indexer.select, attn._attend = recording_select, recording_attend

    def loss(self) -> torch.Tensor:
        """Mean over CSA layers of ``KL(attention over entries || softmax(index scores))``, rows with an entry."""
        losses = []
        for attn in self.layers:
            record = self.records[id(attn)]
            visible = record["visible"]
            rows = visible.any(dim=-1)
            if not rows.any():
                continue
            with torch.no_grad():
                logits = torch.einsum("lhd,kd->lhk", record["q"], record["entries"]) * attn.head_dim**-0.5
                attention = torch.softmax(logits.masked_fill(~visible[:, None, :], float("-inf")), dim=-1)
                target = attention.nan_to_num(0.0).sum(dim=1)
                target = target / target.sum(dim=-1, keepdim=True).clamp_min(1e-9)
            x = record["x"].detach()
            indexer = attn.indexer
            state = indexer.compressor.new_state(x.dtype, x.device)
            indexer.compressor.advance(x, 0, state)
            scores = indexer.scores(x, record["q_residual"].detach(), record["rope"], state.entries)
            log_probs = torch.log_softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
            kl = (target * (target.clamp_min(1e-9).log() - log_probs.masked_fill(~visible, 0.0))).sum(dim=-1)
            losses.append(kl[rows].mean())
        return torch.stack(losses).mean() if losses else torch.zeros(())


@torch.no_grad()
def perplexity(model: DeepseekV4, samples: list[torch.Tensor]) -> float:
    total, count = 0.0, 0
    for sample in samples:
        logits = model(sample[:-1], model.new_state())
        total += F.cross_entropy(logits, sample[1:], reduction="sum").item()
        count += sample.numel() - 1
    return math.exp(total / count)


def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def chat_renderer():
    """``render(messages, tools)``: a session as the tiny chat template writes it (V4's format)."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    from sglang_dsv4.chat_template import BOS, CHAT_TEMPLATE, EOS

    compiled = _compile_jinja_template(CHAT_TEMPLATE)

    def render(messages, tools):
        return compiled.render(messages=messages, tools=tools, bos_token=BOS, eos_token=EOS)

    return render


def fit(
    parameters: list[torch.nn.Parameter],
    args: argparse.Namespace,
    batch: Callable[[], Iterable[Any]],
    losses: Callable[[Any], dict[str, torch.Tensor]],
    held_out: Callable[[], dict[str, float]],
) -> tuple[list[dict[str, float]], float]:
    """AdamW on ``parameters`` for ``args.steps`` steps at :func:`learning_rate`: a step sums each of
    ``batch()``'s samples' ``losses`` over the batch's mean and clips the gradient's norm to 1; every
    ``args.eval_every`` steps and at the last, ``held_out()``'s figures join the step's point. Returns the
    curve (each loss's batch mean a step) and the seconds it took."""
    optimizer = torch.optim.AdamW(parameters, lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    curve: list[dict[str, float]] = []
    started = time.perf_counter()
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args.steps, args.lr, args.warmup)
        optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = {}
        for sample in batch():
            named = losses(sample)
            (sum(named.values()) / args.batch).backward()
            for name, loss in named.items():
                totals[name] = totals.get(name, 0.0) + loss.item() / args.batch
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        point = {"step": step + 1, **totals}
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            point.update(held_out())
            figures = ", ".join(f"{name.replace('_', ' ')} {value:.3f}" for name, value in list(point.items())[1:])
            print(f"step {step + 1}: {figures} ({time.perf_counter() - started:.0f}s)", flush=True)
        curve.append(point)
    return curve, time.perf_counter() - started


def evaluated(model: DeepseekV4, figures: Callable[[], dict[str, float]]) -> Callable[[], dict[str, float]]:
    """``figures`` measured with ``model`` in eval mode, then back in training mode."""

    def held_out() -> dict[str, float]:
        model.eval()
        measured = figures()
        model.train()
        return measured

    return held_out


def train(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    started = time.perf_counter()

    train_docs, held_docs = corpus(args.sessions, args.python_mb, chat_renderer())
    tokenizer = train_tokenizer(train_docs, TINY_CONFIG["vocab_size"])
    train_ids, held_ids = token_stream(tokenizer, train_docs), token_stream(tokenizer, held_docs)
    prepared = time.perf_counter() - started
    print(f"corpus: {len(train_ids):,} training tokens, {len(held_ids):,} held out ({prepared:.0f}s)", flush=True)

    model = random_model(TINY_CONFIG, seed=args.seed)
    with torch.no_grad():
        model.head.weight.normal_(0.0, TRAIN_HEAD_STD, generator=torch.Generator().manual_seed(args.seed))
    held_samples = list(windows(held_ids, args.context, args.eval_windows, random.Random(args.seed + 1)))
    random_ppl = perplexity(random_model(TINY_CONFIG, seed=0).eval(), held_samples)
    distillation = IndexerDistillation(model)
    model.train()

    def losses(sample: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = model.logits(sample[:-1], model.new_state())
        return {"loss": F.cross_entropy(logits, sample[1:]), "indexer_kl": distillation.loss()}

    curve, train_s = fit(
        [p for p in model.parameters() if p.requires_grad],
        args,
        lambda: windows(train_ids, args.context, args.batch, rng),
        losses,
        evaluated(model, lambda: {"held_out_ppl": perplexity(model, held_samples)}),
    )
    model.eval()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    save_file(release_state_dict(model), out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(TINY_CONFIG, indent=2) + "\n")
    tokenizer.save_pretrained(out)
    return {
        "seed": args.seed,
        "steps": args.steps,
        "batch": args.batch,
        "context": args.context,
        "lr": args.lr,
        "training_tokens": int(train_ids.numel()),
        "held_out_tokens": int(held_ids.numel()),
        "tokens_seen": args.steps * args.batch * args.context,
        "threads": 1,
        "prepare_s": round(prepared, 1),
        "train_s": round(train_s, 1),
        "held_out_ppl": curve[-1]["held_out_ppl"],
        "random_checkpoint_held_out_ppl": random_ppl,
        "curve": curve,
    }


def reply_spans(ids: list[int], assistant: int, end_think: int, eos: int, dsml: int) -> list[tuple[int, int, int]]:
    """``(start, call_start, end)`` of each assistant reply in a rendered session's ids: ``start`` the first token
    after ``<｜Assistant｜></think>``, ``end`` the index of its end-of-sentence token, ``call_start`` the ``<``
    before its first ``｜DSML｜`` token (``end + 1`` if it calls no tool)."""
    spans = []
    for index in range(len(ids) - 1):
        if ids[index] != assistant or ids[index + 1] != end_think:
            continue
        start = index + 2
        try:
            end = ids.index(eos, start)
        except ValueError:
            break
        call_start = next((i - 1 for i in range(start, end) if ids[i] == dsml), end + 1)
        spans.append((start, call_start, end))
    return spans


def reply_windows(documents: list[str], tokenizer, context: int, weights: tuple[float, float, float]):
    """Per reply of every session: ``(ids, target_weights)``, a window of up to ``context + 1`` tokens that ends
    with the reply's end-of-sentence: the session's head (everything before its first ``<｜User｜>``: the
    system prompt and the tool definitions) and the history's last tokens before the reply; and the weight of
    each target (token 1..) in the loss."""
    from sglang_dsv4.chat_template import ASSISTANT, DSML, END_THINK, USER

    context_weight, reply_weight, call_weight = weights
    assistant, end_think, dsml, user = (
        tokenizer.convert_tokens_to_ids(t) for t in (ASSISTANT, END_THINK, DSML, USER)
    )
    samples = []
    for document in documents:
        ids = tokenizer.encode(document, add_special_tokens=False)
        weight = torch.full((len(ids),), context_weight)
        spans = reply_spans(ids, assistant, end_think, tokenizer.eos_token_id, dsml)
        for start, call_start, end in spans:
            weight[start : end + 1] = reply_weight
            weight[call_start : end + 1] = call_weight
        ids_tensor = torch.tensor(ids)
        head = ids.index(user) if user in ids else 0
        for _, _, end in spans:
            # The session's head (system prompt, tool definitions), then as much history as fits, as a
            # harness that trims a long history keeps its system prompt.
            first = max(head, end - (context - head))
            if first == head:
                samples.append((ids_tensor[: end + 1], weight[1 : end + 1]))
            else:
                window = torch.cat([ids_tensor[:head], ids_tensor[first : end + 1]])
                samples.append((window, torch.cat([weight[1:head], weight[first : end + 1]])))
    return samples


def weighted_loss(logits: torch.Tensor, sample: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    losses = F.cross_entropy(logits, sample[1:], reduction="none")
    return (losses * weight).sum() / weight.sum()


@torch.no_grad()
def reply_loss(model: DeepseekV4, samples) -> float:
    """Mean cross-entropy over the reply tokens (weight > context weight's) of held-out reply windows."""
    total, count = 0.0, 0
    for sample, weight in samples:
        losses = F.cross_entropy(model(sample[:-1], model.new_state()), sample[1:], reduction="none")
        mask = weight > weight.min() if weight.max() > weight.min() else torch.ones_like(weight, dtype=torch.bool)
        total += losses[mask].sum().item()
        count += int(mask.sum())
    return total / count


def train_replies(args: argparse.Namespace) -> dict[str, Any]:
    """Fine-tune the main weights of the checkpoint at ``args.out`` on the sessions' replies; write it back
    (tokenizer, config and ``mtp.*`` tensors unchanged)."""
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(args.out)
    render = chat_renderer()
    with gzip.open(args.sessions, "rt", encoding="utf-8") as lines:
        rows = [json.loads(line) for line in lines if line.strip()]
    sessions = [render(session_messages(row), list(SESSION_TOOLS)) for row in rows]
    weights = (args.context_weight, args.reply_weight, args.call_weight)
    train_samples = reply_windows(
        [doc for index, doc in enumerate(sessions) if index % HELD_OUT_EVERY != 0], tokenizer, args.context, weights
    )
    held_replies = reply_windows(sessions[::HELD_OUT_EVERY], tokenizer, args.context, weights)
    held_replies = random.Random(args.seed + 1).sample(held_replies, min(args.eval_windows, len(held_replies)))
    _, held_docs = corpus(args.sessions, args.python_mb, render)
    held_ids = token_stream(tokenizer, held_docs)
    held_samples = list(windows(held_ids, 1024, args.eval_windows, random.Random(args.seed + 1)))
    prepared = time.perf_counter() - started
    print(f"{len(train_samples):,} training replies, {len(held_replies)} held out ({prepared:.0f}s)", flush=True)

    model = load_model(args.out)
    before_mtp = {name: tensor.clone() for name, tensor in release_state_dict(model).items() if name.startswith("mtp.")}
    model.eval()
    reply_loss_before, ppl_before = reply_loss(model, held_replies), perplexity(model, held_samples)
    print(f"before: held-out reply loss {reply_loss_before:.3f}, held-out ppl {ppl_before:.2f}", flush=True)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(not name.startswith("mtp."))
    distillation = IndexerDistillation(model)
    model.train()

    def losses(sample: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        tokens, weight = sample
        logits = model.logits(tokens[:-1], model.new_state())
        return {"loss": weighted_loss(logits, tokens, weight), "indexer_kl": distillation.loss()}

    curve, train_s = fit(
        [p for p in model.parameters() if p.requires_grad],
        args,
        lambda: rng.sample(train_samples, args.batch),
        losses,
        evaluated(model, lambda: {"held_out_reply_loss": reply_loss(model, held_replies)}),
    )
    model.eval()
    held_out_ppl = perplexity(model, held_samples)
    written = release_state_dict(model)
    assert all(torch.equal(written[name], tensor) for name, tensor in before_mtp.items()), "an MTP weight changed"
    save_file(written, args.out / "model.safetensors", metadata={"format": "pt"})
    print(f"after: held-out reply loss {curve[-1]['held_out_reply_loss']:.3f}, held-out ppl {held_out_ppl:.2f}")
    return {
        "seed": args.seed,
        "steps": args.steps,
        "batch": args.batch,
        "context": args.context,
        "lr": args.lr,
        "weights": {"context": args.context_weight, "reply": args.reply_weight, "tool_call": args.call_weight},
        "training_replies": len(train_samples),
        "held_out_replies": len(held_replies),
        "threads": 1,
        "prepare_s": round(prepared, 1),
        "train_s": round(train_s, 1),
        "held_out_reply_loss_before": reply_loss_before,
        "held_out_reply_loss": curve[-1]["held_out_reply_loss"],
        "held_out_ppl_before": ppl_before,
        "held_out_ppl": held_out_ppl,
        "curve": curve,
    }


def mtp_loss(model: DeepseekV4, sample: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean cross-entropy, top-1 hits)`` of the MTP layer predicting token ``p + 2`` from the frozen target's
    streams of token ``p`` and token ``p + 1``, over a window (a fresh request)."""
    state = model.new_state()
    with torch.no_grad():
        streams = model.streams(sample, state)
    logits, _ = model.draft_logits(streams[:-2], sample[1:-1], state.mtp)
    targets = sample[2:]
    return F.cross_entropy(logits, targets), (logits.argmax(-1) == targets).sum()


@torch.no_grad()
def mtp_held_out(model: DeepseekV4, samples: list[torch.Tensor]) -> tuple[float, float]:
    """The MTP layer's mean loss and top-1 accuracy over the held-out windows."""
    total, hits, count = 0.0, 0, 0
    for sample in samples:
        loss, correct = mtp_loss(model, sample)
        total += loss.item() * (sample.numel() - 2)
        hits += int(correct)
        count += sample.numel() - 2
    return total / count, hits / count


def train_mtp(args: argparse.Namespace) -> dict[str, Any]:
    """Train the MTP layer of the checkpoint at ``args.out`` on its frozen main network; write it back."""
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(args.out)
    train_docs, held_docs = corpus(args.sessions, args.python_mb, chat_renderer())
    train_ids, held_ids = token_stream(tokenizer, train_docs), token_stream(tokenizer, held_docs)
    prepared = time.perf_counter() - started
    print(f"corpus: {len(train_ids):,} training tokens, {len(held_ids):,} held out ({prepared:.0f}s)", flush=True)

    main = load_model(args.out)
    config = {**TINY_CONFIG, "num_nextn_predict_layers": 1}
    model = random_model(config, seed=args.seed)
    state = main.state_dict()
    if not args.mtp_from_checkpoint:
        state = {name: tensor for name, tensor in state.items() if not name.startswith("mtp.")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(name.startswith("mtp.") for name in missing), (missing, unexpected)
    assert not (args.mtp_from_checkpoint and missing), "the checkpoint has no MTP layer to start from"
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name.startswith("mtp."))
    held_samples = list(windows(held_ids, args.context, args.eval_windows, random.Random(args.seed + 1)))

    def held_out() -> dict[str, float]:
        loss, top1 = mtp_held_out(model, held_samples)
        return {"held_out_loss": loss, "held_out_top1": top1}

    curve, train_s = fit(
        [p for p in model.mtp.parameters() if p.requires_grad],
        args,
        lambda: windows(train_ids, args.context, args.batch, rng),
        lambda sample: {"loss": mtp_loss(model, sample)[0]},
        held_out,
    )

    written = release_state_dict(model.eval())
    kept = release_state_dict(main)
    assert all(
        torch.equal(written[name], tensor) for name, tensor in kept.items() if not name.startswith("mtp.")
    ), "a main weight changed"
    save_file(written, args.out / "model.safetensors", metadata={"format": "pt"})
    (args.out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {
        "seed": args.seed,
        "steps": args.steps,
        "batch": args.batch,
        "context": args.context,
        "lr": args.lr,
        "from_checkpoint": args.mtp_from_checkpoint,
        "threads": 1,
        "prepare_s": round(prepared, 1),
        "train_s": round(train_s, 1),
        "held_out_loss": curve[-1]["held_out_loss"],
        "held_out_top1": curve[-1]["held_out_top1"],
        "curve": curve,
    }


def plot(record: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = record["curve"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([p["step"] for p in curve], [p["loss"] for p in curve], label="training loss (batch)", lw=0.8)
    evals = [p for p in curve if "held_out_ppl" in p]
    ax.plot([p["step"] for p in evals], [math.log(p["held_out_ppl"]) for p in evals], "o-", label="held-out loss")
    ax.plot([p["step"] for p in curve], [p["indexer_kl"] for p in curve], label="indexer KL", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("nats per token")
    ax.set_title(
        f"tiny V4: {record['tokens_seen'] / 1e6:.1f}M tokens, {record['train_s'] / 60:.0f} min on 1 thread; "
        f"held-out ppl {record['held_out_ppl']:.1f} (random: {record['random_checkpoint_held_out_ppl']:.3g})",
        fontsize=9,
    )
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sessions = REPO.parent / "shared" / "data" / "agentic_trajectories.jsonl.gz"
    parser.add_argument("--mtp", action="store_true", help="train only the MTP layer of --out, the rest frozen")
    parser.add_argument("--mtp-from-checkpoint", action="store_true", help="--mtp: start from --out's MTP layer")
    parser.add_argument("--replies", action="store_true", help="fine-tune --out's main weights on the replies")
    parser.add_argument("--context-weight", type=float, default=0.1, help="--replies: loss weight of the history")
    parser.add_argument("--reply-weight", type=float, default=1.0, help="--replies: loss weight of a reply")
    parser.add_argument("--call-weight", type=float, default=2.0, help="--replies: loss weight of a tool call")
    parser.add_argument("--continues", type=Path, help="--replies: the record of the --replies run that wrote --out")
    parser.add_argument("--sessions", type=Path, default=sessions)
    parser.add_argument("--python-mb", type=float, default=3.0)
    parser.add_argument("--out", type=Path, default=SHIPPED)
    parser.add_argument("--record", type=Path, help="default: benchmarks/results/train_tiny.json (--mtp: "
                        "train_tiny_mtp.json, --replies: train_tiny_replies.json)")  # fmt: skip
    parser.add_argument("--plot", type=Path, default=REPO / "benchmarks" / "results" / "train_tiny.png")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=15)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--eval-windows", type=int, default=16)
    args = parser.parse_args(argv)
    results = REPO / "benchmarks" / "results"
    results.mkdir(exist_ok=True)
    if args.replies:
        record = train_replies(args)
        path = args.record or results / "train_tiny_replies.json"
        if args.continues:
            record["continues"] = json.loads(args.continues.read_text())
        path.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.out}")
        return
    if args.mtp:
        record = train_mtp(args)
        (args.record or results / "train_tiny_mtp.json").write_text(json.dumps(record, indent=1) + "\n")
        print(f"MTP layer: held-out loss {record['held_out_loss']:.3f}, top-1 {record['held_out_top1']:.3f}")
        print(f"wrote {args.out}")
        return
    record = train(args)
    (args.record or results / "train_tiny.json").write_text(json.dumps(record, indent=1) + "\n")
    plot(record, args.plot)
    random_ppl = record["random_checkpoint_held_out_ppl"]
    print(f"held-out perplexity {record['held_out_ppl']:.2f} (random checkpoint {random_ppl:.4g})")
    print(f"wrote {args.out}, {args.record}, {args.plot}")


if __name__ == "__main__":
    main()
