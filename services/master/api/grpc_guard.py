"""The gRPC boundary's first check: a request the protobuf decoder refuses is ``INVALID_ARGUMENT``.

The decoder refuses corrupt bytes, and messages or groups nested past its recursion limit (100 levels,
a bound of its own, so no nesting inside a message reaches the master's code). grpc answers a failing
deserializer with ``UNKNOWN`` ("Unexpected DecodeError"), which the SDK reads as a bug in the master:
here the deserializer hands such a request on as :class:`Undecodable` and the method answers the 4xx.
The user data nested inside a message (configs, fixed parts) are JSON strings, limited where the use
cases parse them (``core.text.check_json_depth``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any

import grpc
from google.protobuf.message import DecodeError


class Undecodable:
    """A request whose bytes the decoder refused, and why."""

    def __init__(self, error: DecodeError) -> None:
        self.error = error

    def message(self) -> str:
        return f"the request is not a valid protobuf message of this call ({self.error}); send it as the proto declares"


def _decoding(decode: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(raw: bytes) -> Any:
        try:
            return decode(raw)
        except DecodeError as e:
            return Undecodable(e)

    return deserialize


def guarded(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """``handler`` (a unary-request one) answering ``INVALID_ARGUMENT`` to a request it cannot decode."""
    h: Any = handler  # grpc's handlers are namedtuples; the stubs declare only the abstract class
    if h.unary_unary is not None:
        unary = h.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            if isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message())
            return await unary(request, context)

        return h._replace(request_deserializer=_decoding(h.request_deserializer), unary_unary=unary_unary)  # type: ignore[no-any-return]
    if h.unary_stream is not None:
        stream = h.unary_stream

        async def unary_stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            # grpc tells an async stream from a sync one by the function's kind: this one must be an async
            # generator itself, so it passes the method's messages on
            if isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message())
            async for message in stream(request, context):
                yield message

        return h._replace(request_deserializer=_decoding(h.request_deserializer), unary_stream=unary_stream)  # type: ignore[no-any-return]
    return handler


class GuardedRegistration:
    """Stands for the server where generated code registers a servicer (``add_XServicer_to_server``): every
    method handler it registers is :func:`guarded`."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self.server = server

    def add_generic_rpc_handlers(self, _handlers: Iterable[grpc.GenericRpcHandler]) -> None:
        pass  # built from the same handlers as add_registered_method_handlers's, which registers them guarded

    def add_registered_method_handlers(self, service: str, handlers: Mapping[str, grpc.RpcMethodHandler]) -> None:
        safe = {name: guarded(h) for name, h in handlers.items()}
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, safe),))
        self.server.add_registered_method_handlers(service, safe)
