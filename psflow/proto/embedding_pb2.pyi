from . import ps_pb2 as _ps_pb2
from . import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CreateTableRequest(_message.Message):
    __slots__ = ("config_json", "shard_index", "num_shards", "move_id")
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    MOVE_ID_FIELD_NUMBER: _ClassVar[int]
    config_json: str
    shard_index: int
    num_shards: int
    move_id: str
    def __init__(self, config_json: _Optional[str] = ..., shard_index: _Optional[int] = ..., num_shards: _Optional[int] = ..., move_id: _Optional[str] = ...) -> None: ...

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
    __slots__ = ("table", "rows", "candidates", "step", "created", "admitted", "evicted_rows", "evicted_candidates", "dropped_gradients", "lookups", "nbytes", "memory_rows", "disk_rows", "memory_hits", "disk_hits", "disk_bytes_read", "disk_bytes_written", "disk_bytes")
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
    MEMORY_ROWS_FIELD_NUMBER: _ClassVar[int]
    DISK_ROWS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_HITS_FIELD_NUMBER: _ClassVar[int]
    DISK_HITS_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
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
    memory_rows: int
    disk_rows: int
    memory_hits: int
    disk_hits: int
    disk_bytes_read: int
    disk_bytes_written: int
    disk_bytes: int
    def __init__(self, table: _Optional[str] = ..., rows: _Optional[int] = ..., candidates: _Optional[int] = ..., step: _Optional[int] = ..., created: _Optional[int] = ..., admitted: _Optional[int] = ..., evicted_rows: _Optional[int] = ..., evicted_candidates: _Optional[int] = ..., dropped_gradients: _Optional[int] = ..., lookups: _Optional[int] = ..., nbytes: _Optional[int] = ..., memory_rows: _Optional[int] = ..., disk_rows: _Optional[int] = ..., memory_hits: _Optional[int] = ..., disk_hits: _Optional[int] = ..., disk_bytes_read: _Optional[int] = ..., disk_bytes_written: _Optional[int] = ..., disk_bytes: _Optional[int] = ...) -> None: ...

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

class RowChunk(_message.Message):
    __slots__ = ("table", "config_json", "ids", "rows", "slots", "touched", "traffic", "candidate_ids", "candidate_counts", "candidate_touched", "step", "counters")
    class SlotsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _tensor_pb2.Tensor
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...
    TABLE_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    TOUCHED_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_IDS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_COUNTS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_TOUCHED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    table: str
    config_json: str
    ids: _tensor_pb2.Tensor
    rows: _tensor_pb2.Tensor
    slots: _containers.MessageMap[str, _tensor_pb2.Tensor]
    touched: _tensor_pb2.Tensor
    traffic: _tensor_pb2.Tensor
    candidate_ids: _tensor_pb2.Tensor
    candidate_counts: _tensor_pb2.Tensor
    candidate_touched: _tensor_pb2.Tensor
    step: int
    counters: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, table: _Optional[str] = ..., config_json: _Optional[str] = ..., ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., rows: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., slots: _Optional[_Mapping[str, _tensor_pb2.Tensor]] = ..., touched: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., traffic: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., candidate_ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., candidate_counts: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., candidate_touched: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., step: _Optional[int] = ..., counters: _Optional[_Iterable[int]] = ...) -> None: ...

class ExportRowsRequest(_message.Message):
    __slots__ = ("move_id", "table", "num_shards", "target_shard", "chunk_index", "max_bytes")
    MOVE_ID_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    TARGET_SHARD_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    move_id: str
    table: str
    num_shards: int
    target_shard: int
    chunk_index: int
    max_bytes: int
    def __init__(self, move_id: _Optional[str] = ..., table: _Optional[str] = ..., num_shards: _Optional[int] = ..., target_shard: _Optional[int] = ..., chunk_index: _Optional[int] = ..., max_bytes: _Optional[int] = ...) -> None: ...

class ExportRowsResponse(_message.Message):
    __slots__ = ("chunk", "more")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    chunk: RowChunk
    more: bool
    def __init__(self, chunk: _Optional[_Union[RowChunk, _Mapping]] = ..., more: _Optional[bool] = ...) -> None: ...

class ImportRowsRequest(_message.Message):
    __slots__ = ("move_id", "source_shard", "chunk_index", "shard_index", "num_shards", "chunk")
    MOVE_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_SHARD_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    move_id: str
    source_shard: int
    chunk_index: int
    shard_index: int
    num_shards: int
    chunk: RowChunk
    def __init__(self, move_id: _Optional[str] = ..., source_shard: _Optional[int] = ..., chunk_index: _Optional[int] = ..., shard_index: _Optional[int] = ..., num_shards: _Optional[int] = ..., chunk: _Optional[_Union[RowChunk, _Mapping]] = ...) -> None: ...

class ImportRowsResponse(_message.Message):
    __slots__ = ("staged", "duplicate")
    STAGED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    staged: int
    duplicate: bool
    def __init__(self, staged: _Optional[int] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class CommitMoveRequest(_message.Message):
    __slots__ = ("move_id", "shard_index", "num_shards")
    MOVE_ID_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    move_id: str
    shard_index: int
    num_shards: int
    def __init__(self, move_id: _Optional[str] = ..., shard_index: _Optional[int] = ..., num_shards: _Optional[int] = ...) -> None: ...

class CommitMoveResponse(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: int
    def __init__(self, rows: _Optional[int] = ...) -> None: ...

class AbortMoveRequest(_message.Message):
    __slots__ = ("move_id",)
    MOVE_ID_FIELD_NUMBER: _ClassVar[int]
    move_id: str
    def __init__(self, move_id: _Optional[str] = ...) -> None: ...

class AbortMoveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
