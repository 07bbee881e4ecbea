"""hivemind codecs for outer gradients: :class:`GridCodec` packs the values of a round's shared grid
(:mod:`p2p_diloco.algo.grid`) losslessly, :class:`RawCodec` sends plain fp32 (the ``none`` codec); both
count the bytes they send and receive.

hivemind picks the decoder of a message by its protobuf ``CompressionType``, which has no slot for
user codecs; :func:`install` puts ours in the ``BLOCKWISE_8BIT`` slot (bitsandbytes' codec, which
p2p_diloco never uses) of the process that is about to fork an averager (Linux's default start
method up to Python 3.13; a spawned averager would keep hivemind's codec). Only our averagers talk
to each other through these groups (their keys carry the run fingerprint, which names the codec).
"""

from __future__ import annotations

import threading
from typing import Optional

import numpy as np
import torch

from p2p_diloco.algo.grid import MAX_MESSAGE_VALUES, _bit_length, decode, encode_grid, encode_raw, levels_of


def _codec_base():
    from hivemind.compression import CompressionBase, CompressionInfo  # noqa: F401
    from hivemind.proto import runtime_pb2

    class WireCodec(CompressionBase):
        """Base of our hivemind codecs: frames :func:`encode_grid` / :func:`encode_raw` payloads in
        hivemind's tensor messages and counts their bytes (sent in ``compress``, received in
        ``extract``) into ``counters`` (int64, [sent, received]; shared memory, so the island reads
        what its averager process counted)."""

        compression_type = runtime_pb2.CompressionType.BLOCKWISE_8BIT
        bits = 32.0

        def __init__(self, counters: Optional[torch.Tensor] = None):
            self.counters = counters
            self._lock = threading.Lock()

        def _count(self, index: int, message) -> None:
            if self.counters is not None:
                with self._lock:
                    self.counters[index] += message.ByteSize()

        def _payload(self, flat: np.ndarray) -> bytes:
            return encode_raw(flat)

        def compress(self, tensor: torch.Tensor, info=None, allow_inplace: bool = False):
            flat = tensor.detach().to("cpu", torch.float32).reshape(-1).numpy()
            message = runtime_pb2.Tensor(compression=self.compression_type, buffer=self._payload(flat),
                                         size=list(tensor.shape), dtype="float32", requires_grad=False)
            self._count(0, message)
            return message

        def extract(self, serialized_tensor) -> torch.Tensor:
            self._count(1, serialized_tensor)
            size = tuple(serialized_tensor.size)
            count = int(np.prod(size, dtype=np.int64)) if size else 1
            if count > MAX_MESSAGE_VALUES:
                raise ValueError(f"a message of {count} values is larger than any fragment part")
            return torch.from_numpy(decode(serialized_tensor.buffer, expected=count)).reshape(size)

        def estimate_compression_ratio(self, info) -> float:
            return self.bits / 32.0

    return WireCodec


def make_codec(codec: str, counters: Optional[torch.Tensor] = None):
    """The hivemind codec of a run's ``outer.codec``: :class:`RawCodec` for ``none``, else
    :class:`GridCodec` (the grid itself is set by :func:`put_on_grid_`, the codec packs it).

    :param counters: int64 shared-memory tensor [bytes sent, bytes received], or None
    :raises ValueError: for an unknown codec name
    """
    levels = levels_of(codec)
    base = _codec_base()
    if levels == 0:
        return type("RawCodec", (base,), {"__doc__": "Plain fp32 tensors (the ``none`` codec), counted."})(counters)
    bits = float(_bit_length(np.array([2 * levels]))[0])

    class GridCodec(base):
        """Lossless packing of grid values (:func:`encode_grid`), counted."""

        def _payload(self, flat: np.ndarray) -> bytes:
            return encode_grid(flat)

    GridCodec.bits = bits
    return GridCodec(counters)


def install(codec) -> None:
    """Make ``codec`` hivemind's decoder and encoder for its slot in this process (and in processes
    forked from it afterwards: call right before starting an averager)."""
    from hivemind.compression import serialization
    from hivemind.proto import runtime_pb2

    serialization._BASE_COMPRESSION_TYPES[runtime_pb2.CompressionType.Name(codec.compression_type)] = codec
