"""The server under test, as the replay sees it: a stream of tokens per request, and optional mode switches.

``ChatServer`` speaks the OpenAI chat API (any OpenAI-compatible server: SGLang, vLLM, ...);
``GenerateServer`` speaks SGLang's ``/generate`` with token ids from the model's chat template. Both ask
for exactly the turn's output length (``ignore_eos``) and stream. Mode switches go through SGLang's admin
routes: ``POST /set_internal_state``, then ``/flush_cache``, then the modes read back from ``GET /server_info``.

Only loopback servers are driven: the benchmark sends heavy sustained traffic, so it runs on the host it
measures.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

import aiohttp

from ..prefix_cache import MODE_CODES, mode_code
from .trajectory import Message

ADMIN_TIMEOUT_S = 60.0
"""Bound on a mode switch or a model listing (a stalled server must not hang the run)."""


@dataclass(frozen=True)
class TokensArrived:
    """Streamed output: ``total`` tokens so far, ``text`` new since the last event."""

    total: int
    text: str


@dataclass(frozen=True)
class Usage:
    """The server's own counts for a finished reply (``None`` where it does not report them)."""

    completion_tokens: int
    prompt_tokens: int | None
    cached_tokens: int | None


StreamEvent = TokensArrived | Usage


class ServerError(RuntimeError):
    """The server refused, failed or broke off a request."""


class Server(Protocol):
    """What the replay drives. ``stream`` raises ``ServerError`` for anything but a streamed reply."""

    url: str

    def stream(
        self, messages: list[Message], output_tokens: int, tools: Sequence[Message]
    ) -> AsyncIterator[StreamEvent]:
        """Send one turn (the whole history, the tools it defines) and yield its reply as it arrives."""
        ...

    async def apply(self, server_args: dict[str, Any]) -> dict[str, Any] | None:
        """Switch the server's modes before a trial; return the modes it reports afterwards, if any."""
        ...


def require_loopback(url: str) -> None:
    """Refuse a URL whose host resolves to anything but this machine's loopback addresses."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) server URL: {url!r}")
    try:
        infos = socket.getaddrinfo(parts.hostname, parts.port or 80, proto=socket.IPPROTO_TCP)
    except socket.gaierror as error:
        raise ValueError(f"cannot resolve {parts.hostname!r}: {error}") from error
    outside = sorted({info[4][0] for info in infos if not ipaddress.ip_address(info[4][0]).is_loopback})
    if outside:
        raise ValueError(f"agentperf drives loopback servers only; {parts.hostname!r} resolves to {', '.join(outside)}")


def parse_sse_line(line: bytes) -> dict[str, Any] | None:
    """The JSON object of one server-sent-events ``data:`` line; ``None`` for other lines and ``[DONE]``."""
    text = line.decode("utf-8").strip()
    if not text.startswith("data:"):
        return None
    data = text[len("data:") :].strip()
    if data == "[DONE]":
        return None
    try:
        event = json.loads(data)
    except json.JSONDecodeError as error:
        raise ServerError(f"unreadable stream event {data[:200]!r}") from error
    if isinstance(event, dict) and "error" in event:
        raise ServerError(f"server error in stream: {str(event['error'])[:300]}")
    return event


class _HttpServer:
    """Shared HTTP plumbing: one session per benchmark, errors turned into ``ServerError``."""

    def __init__(self, url: str, session: aiohttp.ClientSession) -> None:
        require_loopback(url)
        self.url = url.rstrip("/")
        self.session = session

    async def _events(self, route: str, payload: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        try:
            async with self.session.post(f"{self.url}{route}", json=payload) as response:
                if response.status != 200:
                    raise ServerError(f"HTTP {response.status} from {route}: {(await response.text())[:300]}")
                async for line in response.content:
                    event = parse_sse_line(line)
                    if event is not None:
                        yield event
        except aiohttp.ClientError as error:
            raise ServerError(f"{route}: {type(error).__name__}: {error}") from error

    async def apply(self, server_args: dict[str, Any]) -> dict[str, Any] | None:
        """``POST /set_internal_state`` (dsv4 modes named in words are sent as their codes), ``/flush_cache``,
        then the ``dsv4_prefix_cache`` modes read back, by name, from ``/server_info``.

        The flush makes every trial start from an empty prefix cache: configurations sharing a server replay
        the same seeded workload, so each would otherwise resume the prompts the previous one just cached.
        SGLang answers a list with one ``updated`` flag per scheduler (``{"updated": ...}`` is accepted
        too). Keys named ``dsv4_<mode>`` must read back as ``internal_states[0]["dsv4_prefix_cache"][<mode>]``.
        """
        try:
            async with asyncio.timeout(ADMIN_TIMEOUT_S):
                await self._set_internal_state(server_args)
                await self._flush_cache()
                async with self.session.get(f"{self.url}/server_info") as reply:
                    info = await reply.json(content_type=None)
        except (aiohttp.ClientError, json.JSONDecodeError, TimeoutError) as error:
            raise ServerError(f"switching {self.url} to {server_args}: {error}") from error
        modes = (info.get("internal_states") or [{}])[0].get("dsv4_prefix_cache")
        for key, value in server_args.items():
            if key.startswith("dsv4_") and (modes or {}).get(key.removeprefix("dsv4_")) != value:
                raise ServerError(f"{self.url} reports dsv4_prefix_cache {modes} after setting {key}={value!r}")
        return modes

    async def _set_internal_state(self, server_args: dict[str, Any]) -> None:
        async with self.session.post(
            f"{self.url}/set_internal_state", json={"server_args": _numeric(server_args)}
        ) as reply:
            answer = await reply.json(content_type=None)
        flags = answer if isinstance(answer, list) else [answer.get("updated") if isinstance(answer, dict) else None]
        if not flags or not all(flag is True for flag in flags):
            raise ServerError(f"{self.url} refused server_args {server_args}: {str(answer)[:300]}")

    async def _flush_cache(self) -> None:
        # SGLang flushes only an idle server; ``timeout`` waits for the last trial's requests to end.
        async with self.session.post(f"{self.url}/flush_cache", params={"timeout": ADMIN_TIMEOUT_S / 2}) as reply:
            if reply.status != 200:
                raise ServerError(f"{self.url} did not flush its cache: {(await reply.text())[:300]}")


def _numeric(server_args: dict[str, Any]) -> dict[str, Any]:
    """SGLang's internal-state route takes numbers only: a dsv4 mode named in words goes as its code
    (an unknown name goes as it is, for the server to refuse)."""
    return {
        key: mode_code(key, value) if value in MODE_CODES.get(key, ()) else value for key, value in server_args.items()
    }


class ChatServer(_HttpServer):
    """Any OpenAI-compatible server: ``POST /v1/chat/completions`` with ``stream`` and usage."""

    def __init__(self, url: str, session: aiohttp.ClientSession, model: str) -> None:
        super().__init__(url, session)
        self.model = model

    async def stream(
        self, messages: list[Message], output_tokens: int, tools: Sequence[Message]
    ) -> AsyncIterator[StreamEvent]:
        payload = {
            "model": self.model,
            "messages": messages,
            **({"tools": list(tools)} if tools else {}),
            "max_tokens": output_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        total = 0
        async for event in self._events("/v1/chat/completions", payload):
            for choice in event.get("choices") or []:
                delta = choice.get("delta") or {}
                text = (delta.get("reasoning_content") or "") + (delta.get("content") or "")
                if text:
                    total += 1
                    yield TokensArrived(total, delta.get("content") or "")
            if event.get("usage"):
                yield _chat_usage(event["usage"])


def _chat_usage(usage: dict[str, Any]) -> Usage:
    details = usage.get("prompt_tokens_details") or {}
    return Usage(usage["completion_tokens"], usage.get("prompt_tokens"), details.get("cached_tokens"))


class GenerateServer(_HttpServer):
    """SGLang's native ``POST /generate`` with token ids (the history through the model's chat template)."""

    def __init__(self, url: str, session: aiohttp.ClientSession, tokenizer: Any) -> None:
        super().__init__(url, session)
        self.tokenizer = tokenizer

    async def stream(
        self, messages: list[Message], output_tokens: int, tools: Sequence[Message]
    ) -> AsyncIterator[StreamEvent]:
        # Off the event loop: a long history takes milliseconds to tokenize, which would delay other agents' clocks.
        input_ids = await asyncio.to_thread(self._token_ids, messages, tools)
        payload = {
            "input_ids": input_ids,
            "sampling_params": {"max_new_tokens": output_tokens, "ignore_eos": True},
            "stream": True,
        }
        text, meta = "", {}
        async for event in self._events("/generate", payload):
            meta = event.get("meta_info") or {}
            if meta.get("completion_tokens"):
                # SGLang streams the whole text so far; the event's new text is what extends it.
                yield TokensArrived(meta["completion_tokens"], event["text"][len(text) :])
                text = event["text"]
        if meta:
            yield Usage(meta.get("completion_tokens", 0), meta.get("prompt_tokens"), meta.get("cached_tokens"))

    def _token_ids(self, messages: list[Message], tools: Sequence[Message]) -> list[int]:
        """The prompt SGLang's chat serving would render: tool-call arguments parsed, the tools defined."""
        prompt = self.tokenizer.apply_chat_template(
            [_parsed_arguments(message) for message in messages],
            tools=list(tools) or None,
            add_generation_prompt=True,
            tokenize=False,
        )
        return self.tokenizer.encode(prompt, add_special_tokens=False)


def _parsed_arguments(message: Message) -> Message:
    """``message`` with its tool calls' JSON ``arguments`` as objects, as chat templates take them."""
    if not message.get("tool_calls"):
        return message
    calls = [
        {**call, "function": {**call["function"], "arguments": json.loads(call["function"]["arguments"])}}
        if isinstance(call["function"]["arguments"], str)
        else call
        for call in message["tool_calls"]
    ]
    return {**message, "tool_calls": calls}


async def first_model(url: str, session: aiohttp.ClientSession) -> str:
    """The first model a server lists at ``/v1/models`` (the name chat requests must carry)."""
    try:
        async with asyncio.timeout(ADMIN_TIMEOUT_S), session.get(f"{url.rstrip('/')}/v1/models") as reply:
            listing = await reply.json(content_type=None)
        return listing["data"][0]["id"]
    except (aiohttp.ClientError, json.JSONDecodeError, TimeoutError, KeyError, IndexError, TypeError) as error:
        raise ServerError(f"{url}/v1/models lists no model ({error}); pass the model name") from error
