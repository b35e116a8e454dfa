from . import ps_pb2 as _ps_pb2
from . import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CreateTableRequest(_message.Message):
    __slots__ = ("config_json", "shard_index", "num_shards")
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    config_json: str
    shard_index: int
    num_shards: int
    def __init__(self, config_json: _Optional[str] = ..., shard_index: _Optional[int] = ..., num_shards: _Optional[int] = ...) -> None: ...

class CreateTableResponse(_message.Message):
    __slots__ = ("created",)
    CREATED_FIELD_NUMBER: _ClassVar[int]
    created: bool
    def __init__(self, created: _Optional[bool] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("table", "ids", "read_only")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    READ_ONLY_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: _tensor_pb2.Tensor
    read_only: bool
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., read_only: _Optional[bool] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: _tensor_pb2.Tensor
    def __init__(self, rows: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class PushGradientsRequest(_message.Message):
    __slots__ = ("table", "ids", "grads", "request_id", "optimizer_json")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    GRADS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: _tensor_pb2.Tensor
    grads: _tensor_pb2.Tensor
    request_id: _ps_pb2.RequestId
    optimizer_json: str
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., grads: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., request_id: _Optional[_Union[_ps_pb2.RequestId, _Mapping]] = ..., optimizer_json: _Optional[str] = ...) -> None: ...

class PushGradientsResponse(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    def __init__(self, step: _Optional[int] = ...) -> None: ...

class HotRowsRequest(_message.Message):
    __slots__ = ("table", "count")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    table: str
    count: int
    def __init__(self, table: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class HotRowsResponse(_message.Message):
    __slots__ = ("ids", "rows", "traffic")
    IDS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_FIELD_NUMBER: _ClassVar[int]
    ids: _tensor_pb2.Tensor
    rows: _tensor_pb2.Tensor
    traffic: _tensor_pb2.Tensor
    def __init__(self, ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., rows: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., traffic: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class GetTableStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TableStats(_message.Message):
    __slots__ = ("table", "rows", "candidates", "step", "created", "admitted", "evicted_rows", "evicted_candidates", "dropped_gradients", "lookups", "nbytes")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_ROWS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_GRADIENTS_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    table: str
    rows: int
    candidates: int
    step: int
    created: int
    admitted: int
    evicted_rows: int
    evicted_candidates: int
    dropped_gradients: int
    lookups: int
    nbytes: int
    def __init__(self, table: _Optional[str] = ..., rows: _Optional[int] = ..., candidates: _Optional[int] = ..., step: _Optional[int] = ..., created: _Optional[int] = ..., admitted: _Optional[int] = ..., evicted_rows: _Optional[int] = ..., evicted_candidates: _Optional[int] = ..., dropped_gradients: _Optional[int] = ..., lookups: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class GetTableStatsResponse(_message.Message):
    __slots__ = ("tables", "bytes_in", "bytes_out")
    TABLES_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[TableStats]
    bytes_in: int
    bytes_out: int
    def __init__(self, tables: _Optional[_Iterable[_Union[TableStats, _Mapping]]] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ...) -> None: ...

class SaveTablesRequest(_message.Message):
    __slots__ = ("directory",)
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    directory: str
    def __init__(self, directory: _Optional[str] = ...) -> None: ...

class SaveTablesResponse(_message.Message):
    __slots__ = ("path", "tables")
    PATH_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    path: str
    tables: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, path: _Optional[str] = ..., tables: _Optional[_Iterable[str]] = ...) -> None: ...

class RestoreTablesRequest(_message.Message):
    __slots__ = ("directory", "shard_index", "num_shards")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    directory: str
    shard_index: int
    num_shards: int
    def __init__(self, directory: _Optional[str] = ..., shard_index: _Optional[int] = ..., num_shards: _Optional[int] = ...) -> None: ...

class RestoreTablesResponse(_message.Message):
    __slots__ = ("tables", "rows")
    TABLES_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedScalarFieldContainer[str]
    rows: int
    def __init__(self, tables: _Optional[_Iterable[str]] = ..., rows: _Optional[int] = ...) -> None: ...
