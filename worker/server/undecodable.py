"""A gRPC request whose bytes are not its method's message is refused with INVALID_ARGUMENT.

grpc parses a request before the servicer sees it, and a parse failure ends the call UNKNOWN
("Unexpected DecodeError"): an input error reported as a server fault. This interceptor hands
the servicer's handler the raw bytes and parses them itself, so bytes that are not the message
(a pickle, say: nothing here ever unpickles) get a refusal naming the message type. Installed
after the token interceptor, so an unauthenticated caller is refused before anything is parsed.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

Parse = Callable[[bytes], Any]


async def _parse(parse: Parse, raw: bytes, context: grpc.aio.ServicerContext, what: str) -> Any:
    try:
        return parse(raw)
    except (DecodeError, ValueError) as exc:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a {what} message: {exc}"
        )


def _what(parse: Parse) -> str:
    owner = getattr(parse, "__self__", None)  # a message class's FromString
    return getattr(getattr(owner, "DESCRIPTOR", None), "full_name", "request")


def _unary(behaviour: Callable[..., Awaitable[Any]], parse: Parse) -> Callable[..., Any]:
    what = _what(parse)

    async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        return await behaviour(await _parse(parse, raw, context, what), context)

    return handle


def _stream(behaviour: Callable[..., AsyncIterator[Any]], parse: Parse) -> Callable[..., Any]:
    what = _what(parse)

    async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        inner = behaviour(await _parse(parse, raw, context, what), context)
        try:
            async for item in inner:
                yield item
        finally:  # a cancelled call runs the servicer's clean-up now, not at garbage collection
            await inner.aclose()  # type: ignore[attr-defined]

    return handle


class RefuseUndecodable(grpc.aio.ServerInterceptor):
    """Parses unary requests itself, refusing bytes that are not the message (module doc)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer
        out = handler.response_serializer
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _unary(handler.unary_unary, parse), response_serializer=out
            )
        if not inspect.isasyncgenfunction(handler.unary_stream):
            # A stream written through context.write (the health service's Watch): left as it
            # is; every streaming method of ours is an async generator.
            return handler
        return grpc.unary_stream_rpc_method_handler(
            _stream(handler.unary_stream, parse), response_serializer=out
        )
