from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PoolKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POOL_KIND_UNSPECIFIED: _ClassVar[PoolKind]
    POOL_KIND_MHA: _ClassVar[PoolKind]
    POOL_KIND_MLA: _ClassVar[PoolKind]
    POOL_KIND_DSA_INDEXER: _ClassVar[PoolKind]
    POOL_KIND_LOGICAL: _ClassVar[PoolKind]
    POOL_KIND_OPAQUE: _ClassVar[PoolKind]

class KeyFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KEY_FORMAT_DIGEST: _ClassVar[KeyFormat]
    KEY_FORMAT_VLLM: _ClassVar[KeyFormat]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT8_E4M3: _ClassVar[DType]
    DTYPE_FLOAT8_E5M2: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]

class Layout(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LAYOUT_UNSPECIFIED: _ClassVar[Layout]
    LAYOUT_LAYER_FIRST: _ClassVar[Layout]
    LAYOUT_PAGE_FIRST: _ClassVar[Layout]
    LAYOUT_PAGE_FIRST_DIRECT: _ClassVar[Layout]

class BufferRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BUFFER_ROLE_UNSPECIFIED: _ClassVar[BufferRole]
    BUFFER_ROLE_K: _ClassVar[BufferRole]
    BUFFER_ROLE_V: _ClassVar[BufferRole]
    BUFFER_ROLE_KV: _ClassVar[BufferRole]
    BUFFER_ROLE_INDEX: _ClassVar[BufferRole]

class PoolState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POOL_STATE_READY: _ClassVar[PoolState]
    POOL_STATE_CREATING: _ClassVar[PoolState]
    POOL_STATE_FAILED: _ClassVar[PoolState]

class Completion(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMPLETION_WAIT: _ClassVar[Completion]
    COMPLETION_LAYER_EVENTS: _ClassVar[Completion]

class StoreStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STORE_STATUS_UNSPECIFIED: _ClassVar[StoreStatus]
    STORE_STATUS_STORED: _ClassVar[StoreStatus]
    STORE_STATUS_ALREADY_PRESENT: _ClassVar[StoreStatus]
    STORE_STATUS_NO_SPACE: _ClassVar[StoreStatus]

class CacheEventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CACHE_EVENT_KIND_UNSPECIFIED: _ClassVar[CacheEventKind]
    CACHE_EVENT_KIND_STORED: _ClassVar[CacheEventKind]
    CACHE_EVENT_KIND_REMOVED: _ClassVar[CacheEventKind]
    CACHE_EVENT_KIND_EVICTED: _ClassVar[CacheEventKind]
POOL_KIND_UNSPECIFIED: PoolKind
POOL_KIND_MHA: PoolKind
POOL_KIND_MLA: PoolKind
POOL_KIND_DSA_INDEXER: PoolKind
POOL_KIND_LOGICAL: PoolKind
POOL_KIND_OPAQUE: PoolKind
KEY_FORMAT_DIGEST: KeyFormat
KEY_FORMAT_VLLM: KeyFormat
DTYPE_UNSPECIFIED: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT16: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT8_E4M3: DType
DTYPE_FLOAT8_E5M2: DType
DTYPE_UINT8: DType
LAYOUT_UNSPECIFIED: Layout
LAYOUT_LAYER_FIRST: Layout
LAYOUT_PAGE_FIRST: Layout
LAYOUT_PAGE_FIRST_DIRECT: Layout
BUFFER_ROLE_UNSPECIFIED: BufferRole
BUFFER_ROLE_K: BufferRole
BUFFER_ROLE_V: BufferRole
BUFFER_ROLE_KV: BufferRole
BUFFER_ROLE_INDEX: BufferRole
POOL_STATE_READY: PoolState
POOL_STATE_CREATING: PoolState
POOL_STATE_FAILED: PoolState
COMPLETION_WAIT: Completion
COMPLETION_LAYER_EVENTS: Completion
STORE_STATUS_UNSPECIFIED: StoreStatus
STORE_STATUS_STORED: StoreStatus
STORE_STATUS_ALREADY_PRESENT: StoreStatus
STORE_STATUS_NO_SPACE: StoreStatus
CACHE_EVENT_KIND_UNSPECIFIED: CacheEventKind
CACHE_EVENT_KIND_STORED: CacheEventKind
CACHE_EVENT_KIND_REMOVED: CacheEventKind
CACHE_EVENT_KIND_EVICTED: CacheEventKind

class Geometry(_message.Message):
    __slots__ = ("kind", "dtype", "layer_num", "head_num", "head_dim", "v_head_dim", "kv_lora_rank", "qk_rope_head_dim", "index_head_dim", "quant_block_size", "row_bytes")
    KIND_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LAYER_NUM_FIELD_NUMBER: _ClassVar[int]
    HEAD_NUM_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    V_HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    KV_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    QK_ROPE_HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    INDEX_HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    QUANT_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ROW_BYTES_FIELD_NUMBER: _ClassVar[int]
    kind: PoolKind
    dtype: DType
    layer_num: int
    head_num: int
    head_dim: int
    v_head_dim: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    index_head_dim: int
    quant_block_size: int
    row_bytes: int
    def __init__(self, kind: _Optional[_Union[PoolKind, str]] = ..., dtype: _Optional[_Union[DType, str]] = ..., layer_num: _Optional[int] = ..., head_num: _Optional[int] = ..., head_dim: _Optional[int] = ..., v_head_dim: _Optional[int] = ..., kv_lora_rank: _Optional[int] = ..., qk_rope_head_dim: _Optional[int] = ..., index_head_dim: _Optional[int] = ..., quant_block_size: _Optional[int] = ..., row_bytes: _Optional[int] = ...) -> None: ...

class SidePool(_message.Message):
    __slots__ = ("name", "geometry")
    NAME_FIELD_NUMBER: _ClassVar[int]
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    name: str
    geometry: Geometry
    def __init__(self, name: _Optional[str] = ..., geometry: _Optional[_Union[Geometry, _Mapping]] = ...) -> None: ...

class PoolSpec(_message.Message):
    __slots__ = ("name", "kind", "dtype", "layout", "page_size", "layer_num", "head_num", "head_dim", "v_head_dim", "kv_lora_rank", "qk_rope_head_dim", "index_head_dim", "quant_block_size", "size_tokens", "size_bytes", "side_pools", "canary_read_bytes", "row_bytes", "key_format")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYER_NUM_FIELD_NUMBER: _ClassVar[int]
    HEAD_NUM_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    V_HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    KV_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    QK_ROPE_HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    INDEX_HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    QUANT_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SIZE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SIDE_POOLS_FIELD_NUMBER: _ClassVar[int]
    CANARY_READ_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROW_BYTES_FIELD_NUMBER: _ClassVar[int]
    KEY_FORMAT_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: PoolKind
    dtype: DType
    layout: Layout
    page_size: int
    layer_num: int
    head_num: int
    head_dim: int
    v_head_dim: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    index_head_dim: int
    quant_block_size: int
    size_tokens: int
    size_bytes: int
    side_pools: _containers.RepeatedCompositeFieldContainer[SidePool]
    canary_read_bytes: int
    row_bytes: int
    key_format: KeyFormat
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[_Union[PoolKind, str]] = ..., dtype: _Optional[_Union[DType, str]] = ..., layout: _Optional[_Union[Layout, str]] = ..., page_size: _Optional[int] = ..., layer_num: _Optional[int] = ..., head_num: _Optional[int] = ..., head_dim: _Optional[int] = ..., v_head_dim: _Optional[int] = ..., kv_lora_rank: _Optional[int] = ..., qk_rope_head_dim: _Optional[int] = ..., index_head_dim: _Optional[int] = ..., quant_block_size: _Optional[int] = ..., size_tokens: _Optional[int] = ..., size_bytes: _Optional[int] = ..., side_pools: _Optional[_Iterable[_Union[SidePool, _Mapping]]] = ..., canary_read_bytes: _Optional[int] = ..., row_bytes: _Optional[int] = ..., key_format: _Optional[_Union[KeyFormat, str]] = ...) -> None: ...

class Pool(_message.Message):
    __slots__ = ("spec", "size_tokens", "page_num", "page_bytes", "used_pages", "free_pages", "capacity_bytes", "used_bytes", "pinned_bytes", "sessions", "keys", "keyed_pages", "raw_pages", "pinned_pages", "metadata_bytes", "state", "progress", "error", "error_reason", "attach_outcome", "generation", "recovered_keys", "disk_keys", "disk_capacity_pages", "remote_namespace", "remote_puts", "remote_pending", "busy_pages", "kv_events_endpoint", "kv_events_replay_endpoint", "cluster_namespace", "cluster_puts", "cluster_pending", "share_bytes", "floor_bytes", "ceiling_bytes", "tenant")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    SIZE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAGE_NUM_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_PAGES_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PINNED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    KEYED_PAGES_FIELD_NUMBER: _ClassVar[int]
    RAW_PAGES_FIELD_NUMBER: _ClassVar[int]
    PINNED_PAGES_FIELD_NUMBER: _ClassVar[int]
    METADATA_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_REASON_FIELD_NUMBER: _ClassVar[int]
    ATTACH_OUTCOME_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RECOVERED_KEYS_FIELD_NUMBER: _ClassVar[int]
    DISK_KEYS_FIELD_NUMBER: _ClassVar[int]
    DISK_CAPACITY_PAGES_FIELD_NUMBER: _ClassVar[int]
    REMOTE_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    REMOTE_PUTS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_PENDING_FIELD_NUMBER: _ClassVar[int]
    BUSY_PAGES_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_REPLAY_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_PUTS_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_PENDING_FIELD_NUMBER: _ClassVar[int]
    SHARE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FLOOR_BYTES_FIELD_NUMBER: _ClassVar[int]
    CEILING_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    spec: PoolSpec
    size_tokens: int
    page_num: int
    page_bytes: int
    used_pages: int
    free_pages: int
    capacity_bytes: int
    used_bytes: int
    pinned_bytes: int
    sessions: int
    keys: int
    keyed_pages: int
    raw_pages: int
    pinned_pages: int
    metadata_bytes: int
    state: PoolState
    progress: float
    error: str
    error_reason: str
    attach_outcome: str
    generation: int
    recovered_keys: int
    disk_keys: int
    disk_capacity_pages: int
    remote_namespace: str
    remote_puts: int
    remote_pending: int
    busy_pages: int
    kv_events_endpoint: str
    kv_events_replay_endpoint: str
    cluster_namespace: str
    cluster_puts: int
    cluster_pending: int
    share_bytes: int
    floor_bytes: int
    ceiling_bytes: int
    tenant: str
    def __init__(self, spec: _Optional[_Union[PoolSpec, _Mapping]] = ..., size_tokens: _Optional[int] = ..., page_num: _Optional[int] = ..., page_bytes: _Optional[int] = ..., used_pages: _Optional[int] = ..., free_pages: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., pinned_bytes: _Optional[int] = ..., sessions: _Optional[int] = ..., keys: _Optional[int] = ..., keyed_pages: _Optional[int] = ..., raw_pages: _Optional[int] = ..., pinned_pages: _Optional[int] = ..., metadata_bytes: _Optional[int] = ..., state: _Optional[_Union[PoolState, str]] = ..., progress: _Optional[float] = ..., error: _Optional[str] = ..., error_reason: _Optional[str] = ..., attach_outcome: _Optional[str] = ..., generation: _Optional[int] = ..., recovered_keys: _Optional[int] = ..., disk_keys: _Optional[int] = ..., disk_capacity_pages: _Optional[int] = ..., remote_namespace: _Optional[str] = ..., remote_puts: _Optional[int] = ..., remote_pending: _Optional[int] = ..., busy_pages: _Optional[int] = ..., kv_events_endpoint: _Optional[str] = ..., kv_events_replay_endpoint: _Optional[str] = ..., cluster_namespace: _Optional[str] = ..., cluster_puts: _Optional[int] = ..., cluster_pending: _Optional[int] = ..., share_bytes: _Optional[int] = ..., floor_bytes: _Optional[int] = ..., ceiling_bytes: _Optional[int] = ..., tenant: _Optional[str] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("version", "transports", "memory_budget_bytes", "memory_used_bytes", "memory_available_bytes", "shm_dir", "cuda_available", "serving", "pools", "sessions", "metrics_port", "cuda_devices", "remote_tier", "fast_path", "fast_path_version", "max_keys_per_call", "fast_path_flags", "kv_events_endpoint", "kv_events_replay_endpoint", "kv_events_topic", "cluster_tier")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_AVAILABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_DIR_FIELD_NUMBER: _ClassVar[int]
    CUDA_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    METRICS_PORT_FIELD_NUMBER: _ClassVar[int]
    CUDA_DEVICES_FIELD_NUMBER: _ClassVar[int]
    REMOTE_TIER_FIELD_NUMBER: _ClassVar[int]
    FAST_PATH_FIELD_NUMBER: _ClassVar[int]
    FAST_PATH_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_KEYS_PER_CALL_FIELD_NUMBER: _ClassVar[int]
    FAST_PATH_FLAGS_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_REPLAY_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_TOPIC_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_TIER_FIELD_NUMBER: _ClassVar[int]
    version: str
    transports: _containers.RepeatedScalarFieldContainer[str]
    memory_budget_bytes: int
    memory_used_bytes: int
    memory_available_bytes: int
    shm_dir: str
    cuda_available: bool
    serving: bool
    pools: int
    sessions: int
    metrics_port: int
    cuda_devices: _containers.RepeatedCompositeFieldContainer[CudaDevice]
    remote_tier: str
    fast_path: str
    fast_path_version: int
    max_keys_per_call: int
    fast_path_flags: int
    kv_events_endpoint: str
    kv_events_replay_endpoint: str
    kv_events_topic: str
    cluster_tier: str
    def __init__(self, version: _Optional[str] = ..., transports: _Optional[_Iterable[str]] = ..., memory_budget_bytes: _Optional[int] = ..., memory_used_bytes: _Optional[int] = ..., memory_available_bytes: _Optional[int] = ..., shm_dir: _Optional[str] = ..., cuda_available: _Optional[bool] = ..., serving: _Optional[bool] = ..., pools: _Optional[int] = ..., sessions: _Optional[int] = ..., metrics_port: _Optional[int] = ..., cuda_devices: _Optional[_Iterable[_Union[CudaDevice, _Mapping]]] = ..., remote_tier: _Optional[str] = ..., fast_path: _Optional[str] = ..., fast_path_version: _Optional[int] = ..., max_keys_per_call: _Optional[int] = ..., fast_path_flags: _Optional[int] = ..., kv_events_endpoint: _Optional[str] = ..., kv_events_replay_endpoint: _Optional[str] = ..., kv_events_topic: _Optional[str] = ..., cluster_tier: _Optional[str] = ...) -> None: ...

class CudaDevice(_message.Message):
    __slots__ = ("uuid", "ordinal", "name", "total_bytes")
    UUID_FIELD_NUMBER: _ClassVar[int]
    ORDINAL_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    uuid: str
    ordinal: int
    name: str
    total_bytes: int
    def __init__(self, uuid: _Optional[str] = ..., ordinal: _Optional[int] = ..., name: _Optional[str] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class CreatePoolRequest(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: PoolSpec
    def __init__(self, spec: _Optional[_Union[PoolSpec, _Mapping]] = ...) -> None: ...

class GetPoolRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ListPoolsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListPoolsResponse(_message.Message):
    __slots__ = ("pools",)
    POOLS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[Pool]
    def __init__(self, pools: _Optional[_Iterable[_Union[Pool, _Mapping]]] = ...) -> None: ...

class DeletePoolRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeletePoolResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShmHandle(_message.Message):
    __slots__ = ("path", "offset", "nbytes")
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    path: str
    offset: int
    nbytes: int
    def __init__(self, path: _Optional[str] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class MemfdHandle(_message.Message):
    __slots__ = ("fd_index", "offset", "nbytes")
    FD_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    fd_index: int
    offset: int
    nbytes: int
    def __init__(self, fd_index: _Optional[int] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class CudaIpcHandle(_message.Message):
    __slots__ = ("handle", "device_uuid", "offset", "nbytes")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    device_uuid: str
    offset: int
    nbytes: int
    def __init__(self, handle: _Optional[bytes] = ..., device_uuid: _Optional[str] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class CudaVmmHandle(_message.Message):
    __slots__ = ("fd_indices", "chunk_bytes", "offset", "nbytes", "device_uuid")
    FD_INDICES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    fd_indices: _containers.RepeatedScalarFieldContainer[int]
    chunk_bytes: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    nbytes: int
    device_uuid: str
    def __init__(self, fd_indices: _Optional[_Iterable[int]] = ..., chunk_bytes: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., device_uuid: _Optional[str] = ...) -> None: ...

class DeviceBuffer(_message.Message):
    __slots__ = ("member", "role", "layer", "shape", "dtype", "strides", "shm", "cuda_ipc", "memfd", "cuda_vmm")
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    STRIDES_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    MEMFD_FIELD_NUMBER: _ClassVar[int]
    CUDA_VMM_FIELD_NUMBER: _ClassVar[int]
    member: str
    role: BufferRole
    layer: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    strides: _containers.RepeatedScalarFieldContainer[int]
    shm: ShmHandle
    cuda_ipc: CudaIpcHandle
    memfd: MemfdHandle
    cuda_vmm: CudaVmmHandle
    def __init__(self, member: _Optional[str] = ..., role: _Optional[_Union[BufferRole, str]] = ..., layer: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ..., strides: _Optional[_Iterable[int]] = ..., shm: _Optional[_Union[ShmHandle, _Mapping]] = ..., cuda_ipc: _Optional[_Union[CudaIpcHandle, _Mapping]] = ..., memfd: _Optional[_Union[MemfdHandle, _Mapping]] = ..., cuda_vmm: _Optional[_Union[CudaVmmHandle, _Mapping]] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("pool", "worker_id", "buffers", "lease_ms", "layer_events", "ready_event", "peer_token")
    POOL_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    LAYER_EVENTS_FIELD_NUMBER: _ClassVar[int]
    READY_EVENT_FIELD_NUMBER: _ClassVar[int]
    PEER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    pool: str
    worker_id: str
    buffers: _containers.RepeatedCompositeFieldContainer[DeviceBuffer]
    lease_ms: int
    layer_events: _containers.RepeatedScalarFieldContainer[bytes]
    ready_event: bytes
    peer_token: str
    def __init__(self, pool: _Optional[str] = ..., worker_id: _Optional[str] = ..., buffers: _Optional[_Iterable[_Union[DeviceBuffer, _Mapping]]] = ..., lease_ms: _Optional[int] = ..., layer_events: _Optional[_Iterable[bytes]] = ..., ready_event: _Optional[bytes] = ..., peer_token: _Optional[str] = ...) -> None: ...

class Session(_message.Message):
    __slots__ = ("session_id", "pool", "worker_id", "lease_ms", "expires_in_ms", "attached_bytes", "device_tokens", "transfers", "device_uuid", "layer_events", "lease_clamped", "public_id", "peer_known", "peer_uid", "peer_gid", "peer_pid", "page_size", "loads_in_flight")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_MS_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    LAYER_EVENTS_FIELD_NUMBER: _ClassVar[int]
    LEASE_CLAMPED_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_KNOWN_FIELD_NUMBER: _ClassVar[int]
    PEER_UID_FIELD_NUMBER: _ClassVar[int]
    PEER_GID_FIELD_NUMBER: _ClassVar[int]
    PEER_PID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    LOADS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    pool: str
    worker_id: str
    lease_ms: int
    expires_in_ms: int
    attached_bytes: int
    device_tokens: int
    transfers: int
    device_uuid: str
    layer_events: int
    lease_clamped: bool
    public_id: str
    peer_known: bool
    peer_uid: int
    peer_gid: int
    peer_pid: int
    page_size: int
    loads_in_flight: int
    def __init__(self, session_id: _Optional[str] = ..., pool: _Optional[str] = ..., worker_id: _Optional[str] = ..., lease_ms: _Optional[int] = ..., expires_in_ms: _Optional[int] = ..., attached_bytes: _Optional[int] = ..., device_tokens: _Optional[int] = ..., transfers: _Optional[int] = ..., device_uuid: _Optional[str] = ..., layer_events: _Optional[int] = ..., lease_clamped: _Optional[bool] = ..., public_id: _Optional[str] = ..., peer_known: _Optional[bool] = ..., peer_uid: _Optional[int] = ..., peer_gid: _Optional[int] = ..., peer_pid: _Optional[int] = ..., page_size: _Optional[int] = ..., loads_in_flight: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: str
    def __init__(self, pool: _Optional[str] = ...) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[Session]
    def __init__(self, sessions: _Optional[_Iterable[_Union[Session, _Mapping]]] = ...) -> None: ...

class AllocRequest(_message.Message):
    __slots__ = ("pool", "num_tokens", "session_id")
    POOL_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    pool: str
    num_tokens: int
    session_id: str
    def __init__(self, pool: _Optional[str] = ..., num_tokens: _Optional[int] = ..., session_id: _Optional[str] = ...) -> None: ...

class AllocResponse(_message.Message):
    __slots__ = ("host_indices",)
    HOST_INDICES_FIELD_NUMBER: _ClassVar[int]
    host_indices: bytes
    def __init__(self, host_indices: _Optional[bytes] = ...) -> None: ...

class FreeRequest(_message.Message):
    __slots__ = ("pool", "host_indices")
    POOL_FIELD_NUMBER: _ClassVar[int]
    HOST_INDICES_FIELD_NUMBER: _ClassVar[int]
    pool: str
    host_indices: bytes
    def __init__(self, pool: _Optional[str] = ..., host_indices: _Optional[bytes] = ...) -> None: ...

class FreeResponse(_message.Message):
    __slots__ = ("pages_freed",)
    PAGES_FREED_FIELD_NUMBER: _ClassVar[int]
    pages_freed: int
    def __init__(self, pages_freed: _Optional[int] = ...) -> None: ...

class TransferRequest(_message.Message):
    __slots__ = ("session_id", "host_indices", "device_indices", "layer_begin", "layer_end", "completion", "deadline_unix_ns")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_INDICES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDICES_FIELD_NUMBER: _ClassVar[int]
    LAYER_BEGIN_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    host_indices: bytes
    device_indices: bytes
    layer_begin: int
    layer_end: int
    completion: Completion
    deadline_unix_ns: int
    def __init__(self, session_id: _Optional[str] = ..., host_indices: _Optional[bytes] = ..., device_indices: _Optional[bytes] = ..., layer_begin: _Optional[int] = ..., layer_end: _Optional[int] = ..., completion: _Optional[_Union[Completion, str]] = ..., deadline_unix_ns: _Optional[int] = ...) -> None: ...

class TransferResponse(_message.Message):
    __slots__ = ("bytes_moved", "pages", "duration_seconds", "pending")
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    DURATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    bytes_moved: int
    pages: int
    duration_seconds: float
    pending: bool
    def __init__(self, bytes_moved: _Optional[int] = ..., pages: _Optional[int] = ..., duration_seconds: _Optional[float] = ..., pending: _Optional[bool] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("pool", "keys", "session_id", "hold_ms", "touch")
    POOL_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    HOLD_MS_FIELD_NUMBER: _ClassVar[int]
    TOUCH_FIELD_NUMBER: _ClassVar[int]
    pool: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    session_id: str
    hold_ms: int
    touch: bool
    def __init__(self, pool: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., session_id: _Optional[str] = ..., hold_ms: _Optional[int] = ..., touch: _Optional[bool] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("hit_prefix", "tiers", "hits", "held", "promised")
    HIT_PREFIX_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    PROMISED_FIELD_NUMBER: _ClassVar[int]
    hit_prefix: int
    tiers: bytes
    hits: int
    held: int
    promised: int
    def __init__(self, hit_prefix: _Optional[int] = ..., tiers: _Optional[bytes] = ..., hits: _Optional[int] = ..., held: _Optional[int] = ..., promised: _Optional[int] = ...) -> None: ...

class ReleaseHoldsRequest(_message.Message):
    __slots__ = ("session_id", "keys")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, session_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ReleaseHoldsResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class StoreRequest(_message.Message):
    __slots__ = ("session_id", "keys", "device_indices", "layer_begin", "layer_end", "token_ids", "parent_key", "deadline_unix_ns", "lora_name", "cache_salt", "lookahead_tokens", "lookahead_token_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDICES_FIELD_NUMBER: _ClassVar[int]
    LAYER_BEGIN_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    device_indices: bytes
    layer_begin: int
    layer_end: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    parent_key: bytes
    deadline_unix_ns: int
    lora_name: str
    cache_salt: str
    lookahead_tokens: int
    lookahead_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., device_indices: _Optional[bytes] = ..., layer_begin: _Optional[int] = ..., layer_end: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., parent_key: _Optional[bytes] = ..., deadline_unix_ns: _Optional[int] = ..., lora_name: _Optional[str] = ..., cache_salt: _Optional[str] = ..., lookahead_tokens: _Optional[int] = ..., lookahead_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StoreResponse(_message.Message):
    __slots__ = ("stored", "already_present", "status", "no_space", "bytes_moved", "duration_seconds")
    STORED_FIELD_NUMBER: _ClassVar[int]
    ALREADY_PRESENT_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    NO_SPACE_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    DURATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    stored: int
    already_present: int
    status: bytes
    no_space: int
    bytes_moved: int
    duration_seconds: float
    def __init__(self, stored: _Optional[int] = ..., already_present: _Optional[int] = ..., status: _Optional[bytes] = ..., no_space: _Optional[int] = ..., bytes_moved: _Optional[int] = ..., duration_seconds: _Optional[float] = ...) -> None: ...

class LoadKeysRequest(_message.Message):
    __slots__ = ("session_id", "keys", "device_indices", "layer_begin", "layer_end", "completion", "deadline_unix_ns")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDICES_FIELD_NUMBER: _ClassVar[int]
    LAYER_BEGIN_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    device_indices: bytes
    layer_begin: int
    layer_end: int
    completion: Completion
    deadline_unix_ns: int
    def __init__(self, session_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., device_indices: _Optional[bytes] = ..., layer_begin: _Optional[int] = ..., layer_end: _Optional[int] = ..., completion: _Optional[_Union[Completion, str]] = ..., deadline_unix_ns: _Optional[int] = ...) -> None: ...

class RemoveKeysRequest(_message.Message):
    __slots__ = ("pool", "keys")
    POOL_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    pool: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, pool: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class RemoveKeysResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: int
    def __init__(self, removed: _Optional[int] = ...) -> None: ...

class ClearPoolRequest(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: str
    def __init__(self, pool: _Optional[str] = ...) -> None: ...

class ClearPoolResponse(_message.Message):
    __slots__ = ("pages_freed", "keys_removed")
    PAGES_FREED_FIELD_NUMBER: _ClassVar[int]
    KEYS_REMOVED_FIELD_NUMBER: _ClassVar[int]
    pages_freed: int
    keys_removed: int
    def __init__(self, pages_freed: _Optional[int] = ..., keys_removed: _Optional[int] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("pool", "after_seq", "all_tiers")
    POOL_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    ALL_TIERS_FIELD_NUMBER: _ClassVar[int]
    pool: str
    after_seq: int
    all_tiers: bool
    def __init__(self, pool: _Optional[str] = ..., after_seq: _Optional[int] = ..., all_tiers: _Optional[bool] = ...) -> None: ...

class CacheEvent(_message.Message):
    __slots__ = ("seq", "kind", "keys", "pool", "tier", "medium", "parent_key", "token_ids", "block_size", "lora_name", "cache_salt", "lookahead_tokens", "lookahead_token_ids")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    kind: CacheEventKind
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    pool: str
    tier: int
    medium: str
    parent_key: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    lora_name: str
    cache_salt: str
    lookahead_tokens: int
    lookahead_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq: _Optional[int] = ..., kind: _Optional[_Union[CacheEventKind, str]] = ..., keys: _Optional[_Iterable[bytes]] = ..., pool: _Optional[str] = ..., tier: _Optional[int] = ..., medium: _Optional[str] = ..., parent_key: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., lora_name: _Optional[str] = ..., cache_salt: _Optional[str] = ..., lookahead_tokens: _Optional[int] = ..., lookahead_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PingRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PingResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("grace_seconds",)
    GRACE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    grace_seconds: float
    def __init__(self, grace_seconds: _Optional[float] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("in_flight", "grace_seconds", "already_draining")
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    GRACE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ALREADY_DRAINING_FIELD_NUMBER: _ClassVar[int]
    in_flight: int
    grace_seconds: float
    already_draining: bool
    def __init__(self, in_flight: _Optional[int] = ..., grace_seconds: _Optional[float] = ..., already_draining: _Optional[bool] = ...) -> None: ...
