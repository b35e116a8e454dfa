from . import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WriteOp(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WRITE_OP_UNSPECIFIED: _ClassVar[WriteOp]
    WRITE_OP_CREATE: _ClassVar[WriteOp]
    WRITE_OP_ASSIGN: _ClassVar[WriteOp]
    WRITE_OP_ASSIGN_ADD: _ClassVar[WriteOp]
    WRITE_OP_ASSIGN_SUB: _ClassVar[WriteOp]

class Compression(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMPRESSION_NONE: _ClassVar[Compression]
    COMPRESSION_FP16: _ClassVar[Compression]
    COMPRESSION_BF16: _ClassVar[Compression]
WRITE_OP_UNSPECIFIED: WriteOp
WRITE_OP_CREATE: WriteOp
WRITE_OP_ASSIGN: WriteOp
WRITE_OP_ASSIGN_ADD: WriteOp
WRITE_OP_ASSIGN_SUB: WriteOp
COMPRESSION_NONE: Compression
COMPRESSION_FP16: Compression
COMPRESSION_BF16: Compression

class RequestId(_message.Message):
    __slots__ = ("client_id", "sequence")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    sequence: int
    def __init__(self, client_id: _Optional[str] = ..., sequence: _Optional[int] = ...) -> None: ...

class VariableSpec(_message.Message):
    __slots__ = ("name", "spec", "trainable", "optimizer_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    TRAINABLE_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    spec: _tensor_pb2.TensorSpec
    trainable: bool
    optimizer_json: str
    def __init__(self, name: _Optional[str] = ..., spec: _Optional[_Union[_tensor_pb2.TensorSpec, _Mapping]] = ..., trainable: _Optional[bool] = ..., optimizer_json: _Optional[str] = ...) -> None: ...

class WriteHeader(_message.Message):
    __slots__ = ("op", "id", "variables")
    OP_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    VARIABLES_FIELD_NUMBER: _ClassVar[int]
    op: WriteOp
    id: RequestId
    variables: _containers.RepeatedCompositeFieldContainer[VariableSpec]
    def __init__(self, op: _Optional[_Union[WriteOp, str]] = ..., id: _Optional[_Union[RequestId, _Mapping]] = ..., variables: _Optional[_Iterable[_Union[VariableSpec, _Mapping]]] = ...) -> None: ...

class WriteRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: WriteHeader
    chunk: _tensor_pb2.Chunk
    def __init__(self, header: _Optional[_Union[WriteHeader, _Mapping]] = ..., chunk: _Optional[_Union[_tensor_pb2.Chunk, _Mapping]] = ...) -> None: ...

class WriteResponse(_message.Message):
    __slots__ = ("versions", "created")
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedScalarFieldContainer[int]
    created: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, versions: _Optional[_Iterable[int]] = ..., created: _Optional[_Iterable[bool]] = ...) -> None: ...

class ConfigureOptimizerRequest(_message.Message):
    __slots__ = ("names", "optimizer_json")
    NAMES_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    optimizer_json: str
    def __init__(self, names: _Optional[_Iterable[str]] = ..., optimizer_json: _Optional[str] = ...) -> None: ...

class ConfigureOptimizerResponse(_message.Message):
    __slots__ = ("slot_names",)
    SLOT_NAMES_FIELD_NUMBER: _ClassVar[int]
    slot_names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, slot_names: _Optional[_Iterable[str]] = ...) -> None: ...

class PullItem(_message.Message):
    __slots__ = ("name", "indices")
    NAME_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    name: str
    indices: _tensor_pb2.Tensor
    def __init__(self, name: _Optional[str] = ..., indices: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("items", "chunk_bytes")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[PullItem]
    chunk_bytes: int
    def __init__(self, items: _Optional[_Iterable[_Union[PullItem, _Mapping]]] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class PulledTensor(_message.Message):
    __slots__ = ("name", "spec", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    spec: _tensor_pb2.TensorSpec
    version: int
    def __init__(self, name: _Optional[str] = ..., spec: _Optional[_Union[_tensor_pb2.TensorSpec, _Mapping]] = ..., version: _Optional[int] = ...) -> None: ...

class PullHeader(_message.Message):
    __slots__ = ("tensors",)
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[PulledTensor]
    def __init__(self, tensors: _Optional[_Iterable[_Union[PulledTensor, _Mapping]]] = ...) -> None: ...

class PullResponse(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PullHeader
    chunk: _tensor_pb2.Chunk
    def __init__(self, header: _Optional[_Union[PullHeader, _Mapping]] = ..., chunk: _Optional[_Union[_tensor_pb2.Chunk, _Mapping]] = ...) -> None: ...

class PushItem(_message.Message):
    __slots__ = ("name", "values", "sparse", "base_version", "compression")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    values: _tensor_pb2.TensorSpec
    sparse: bool
    base_version: int
    compression: Compression
    def __init__(self, name: _Optional[str] = ..., values: _Optional[_Union[_tensor_pb2.TensorSpec, _Mapping]] = ..., sparse: _Optional[bool] = ..., base_version: _Optional[int] = ..., compression: _Optional[_Union[Compression, str]] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("id", "items", "step", "num_required", "wait_applied", "max_staleness", "shm_payload", "rule_json")
    ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    WAIT_APPLIED_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    SHM_PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    RULE_JSON_FIELD_NUMBER: _ClassVar[int]
    id: RequestId
    items: _containers.RepeatedCompositeFieldContainer[PushItem]
    step: int
    num_required: int
    wait_applied: bool
    max_staleness: int
    shm_payload: str
    rule_json: str
    def __init__(self, id: _Optional[_Union[RequestId, _Mapping]] = ..., items: _Optional[_Iterable[_Union[PushItem, _Mapping]]] = ..., step: _Optional[int] = ..., num_required: _Optional[int] = ..., wait_applied: _Optional[bool] = ..., max_staleness: _Optional[int] = ..., shm_payload: _Optional[str] = ..., rule_json: _Optional[str] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    chunk: _tensor_pb2.Chunk
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., chunk: _Optional[_Union[_tensor_pb2.Chunk, _Mapping]] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("versions", "applied", "duplicate", "staleness")
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedScalarFieldContainer[int]
    applied: bool
    duplicate: bool
    staleness: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, versions: _Optional[_Iterable[int]] = ..., applied: _Optional[bool] = ..., duplicate: _Optional[bool] = ..., staleness: _Optional[_Iterable[int]] = ...) -> None: ...

class ListVariablesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VariableInfo(_message.Message):
    __slots__ = ("variable", "slot_names", "version", "optimizer_step", "sync_step", "shm_name")
    VARIABLE_FIELD_NUMBER: _ClassVar[int]
    SLOT_NAMES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STEP_FIELD_NUMBER: _ClassVar[int]
    SYNC_STEP_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    variable: VariableSpec
    slot_names: _containers.RepeatedScalarFieldContainer[str]
    version: int
    optimizer_step: int
    sync_step: int
    shm_name: str
    def __init__(self, variable: _Optional[_Union[VariableSpec, _Mapping]] = ..., slot_names: _Optional[_Iterable[str]] = ..., version: _Optional[int] = ..., optimizer_step: _Optional[int] = ..., sync_step: _Optional[int] = ..., shm_name: _Optional[str] = ...) -> None: ...

class ListVariablesResponse(_message.Message):
    __slots__ = ("variables",)
    VARIABLES_FIELD_NUMBER: _ClassVar[int]
    variables: _containers.RepeatedCompositeFieldContainer[VariableInfo]
    def __init__(self, variables: _Optional[_Iterable[_Union[VariableInfo, _Mapping]]] = ...) -> None: ...

class SaveRequest(_message.Message):
    __slots__ = ("directory", "prefix", "step")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    directory: str
    prefix: str
    step: int
    def __init__(self, directory: _Optional[str] = ..., prefix: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class SaveResponse(_message.Message):
    __slots__ = ("manifest_path", "bytes_written", "names")
    MANIFEST_PATH_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    manifest_path: str
    bytes_written: int
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, manifest_path: _Optional[str] = ..., bytes_written: _Optional[int] = ..., names: _Optional[_Iterable[str]] = ...) -> None: ...

class RestoreRequest(_message.Message):
    __slots__ = ("directory", "prefix", "names")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    directory: str
    prefix: str
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, directory: _Optional[str] = ..., prefix: _Optional[str] = ..., names: _Optional[_Iterable[str]] = ...) -> None: ...

class RestoreResponse(_message.Message):
    __slots__ = ("step", "names")
    STEP_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    step: int
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, step: _Optional[int] = ..., names: _Optional[_Iterable[str]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ("include_log",)
    INCLUDE_LOG_FIELD_NUMBER: _ClassVar[int]
    include_log: bool
    def __init__(self, include_log: _Optional[bool] = ...) -> None: ...

class PushLogEntry(_message.Message):
    __slots__ = ("variable", "client_id", "base_version", "applied_version")
    VARIABLE_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    APPLIED_VERSION_FIELD_NUMBER: _ClassVar[int]
    variable: str
    client_id: str
    base_version: int
    applied_version: int
    def __init__(self, variable: _Optional[str] = ..., client_id: _Optional[str] = ..., base_version: _Optional[int] = ..., applied_version: _Optional[int] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("bytes_in", "bytes_out", "pushes_applied", "pushes_duplicate", "rejected", "staleness_histogram", "max_staleness", "log", "pulls", "num_variables", "variable_bytes", "sync_steps_applied")
    class RejectedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class StalenessHistogramEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    PUSHES_APPLIED_FIELD_NUMBER: _ClassVar[int]
    PUSHES_DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    STALENESS_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    LOG_FIELD_NUMBER: _ClassVar[int]
    PULLS_FIELD_NUMBER: _ClassVar[int]
    NUM_VARIABLES_FIELD_NUMBER: _ClassVar[int]
    VARIABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SYNC_STEPS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    bytes_in: int
    bytes_out: int
    pushes_applied: int
    pushes_duplicate: int
    rejected: _containers.ScalarMap[str, int]
    staleness_histogram: _containers.ScalarMap[int, int]
    max_staleness: int
    log: _containers.RepeatedCompositeFieldContainer[PushLogEntry]
    pulls: int
    num_variables: int
    variable_bytes: int
    sync_steps_applied: int
    def __init__(self, bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., pushes_applied: _Optional[int] = ..., pushes_duplicate: _Optional[int] = ..., rejected: _Optional[_Mapping[str, int]] = ..., staleness_histogram: _Optional[_Mapping[int, int]] = ..., max_staleness: _Optional[int] = ..., log: _Optional[_Iterable[_Union[PushLogEntry, _Mapping]]] = ..., pulls: _Optional[int] = ..., num_variables: _Optional[int] = ..., variable_bytes: _Optional[int] = ..., sync_steps_applied: _Optional[int] = ...) -> None: ...

class ExportShardRequest(_message.Message):
    __slots__ = ("names",)
    NAMES_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, names: _Optional[_Iterable[str]] = ...) -> None: ...

class ExportShardResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: bytes
    def __init__(self, state: _Optional[bytes] = ...) -> None: ...

class ImportShardRequest(_message.Message):
    __slots__ = ("state", "placement_version")
    STATE_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    state: bytes
    placement_version: int
    def __init__(self, state: _Optional[bytes] = ..., placement_version: _Optional[int] = ...) -> None: ...

class ImportShardResponse(_message.Message):
    __slots__ = ("names",)
    NAMES_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, names: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseShardRequest(_message.Message):
    __slots__ = ("names", "owner", "owner_address", "placement_version", "cancel")
    NAMES_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    OWNER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    owner: int
    owner_address: str
    placement_version: int
    cancel: bool
    def __init__(self, names: _Optional[_Iterable[str]] = ..., owner: _Optional[int] = ..., owner_address: _Optional[str] = ..., placement_version: _Optional[int] = ..., cancel: _Optional[bool] = ...) -> None: ...

class ReleaseShardResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DataPlaneInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DataPlaneInfoResponse(_message.Message):
    __slots__ = ("port", "address", "max_payload_bytes")
    PORT_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MAX_PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    port: int
    address: str
    max_payload_bytes: int
    def __init__(self, port: _Optional[int] = ..., address: _Optional[str] = ..., max_payload_bytes: _Optional[int] = ...) -> None: ...
