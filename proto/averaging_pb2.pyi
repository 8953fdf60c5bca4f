from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Codec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CODEC_UNSPECIFIED: _ClassVar[Codec]
    CODEC_INT8_BLOCK: _ClassVar[Codec]
    CODEC_FP32: _ClassVar[Codec]
    CODEC_SPARSE_TOPK: _ClassVar[Codec]
    CODEC_SPARSE_SUPPORT: _ClassVar[Codec]
CODEC_UNSPECIFIED: Codec
CODEC_INT8_BLOCK: Codec
CODEC_FP32: Codec
CODEC_SPARSE_TOPK: Codec
CODEC_SPARSE_SUPPORT: Codec

class PartChunk(_message.Message):
    __slots__ = ("run_id", "round", "hop", "group_id", "part", "sender", "weight", "offset", "length", "codec", "block_size", "values", "scales", "last", "included", "total_weight", "counts", "indices", "top_k")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    HOP_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    INCLUDED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    hop: int
    group_id: bytes
    part: int
    sender: str
    weight: float
    offset: int
    length: int
    codec: Codec
    block_size: int
    values: bytes
    scales: bytes
    last: bool
    included: _containers.RepeatedScalarFieldContainer[str]
    total_weight: float
    counts: bytes
    indices: bytes
    top_k: int
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., hop: _Optional[int] = ..., group_id: _Optional[bytes] = ..., part: _Optional[int] = ..., sender: _Optional[str] = ..., weight: _Optional[float] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., codec: _Optional[_Union[Codec, str]] = ..., block_size: _Optional[int] = ..., values: _Optional[bytes] = ..., scales: _Optional[bytes] = ..., last: _Optional[bool] = ..., included: _Optional[_Iterable[str]] = ..., total_weight: _Optional[float] = ..., counts: _Optional[bytes] = ..., indices: _Optional[bytes] = ..., top_k: _Optional[int] = ...) -> None: ...
