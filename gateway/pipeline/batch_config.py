"""The ``batches:`` section of ``config.yaml``: the Files and Batch APIs and the runner that works
batches off on the fleet's idle capacity (``gateway.batch``), and the contract between that runner and
the plugins that see its lines.

A batch line runs through the same pipeline as a live request. Two things tell the plugins it is one:

- ``ctx.batch_line``: a ``BatchLine`` naming whose batch it is (the key id and tenant that
  created it, checked again for every line: a revoked key's lines are refused). A client cannot set
  it: only the runner builds the context. An access-control plugin (tenancy) authenticates the line by
  it instead of by headers, and may charge it at its batch price.
- ``services.shared[CALLER_OF]``: registered by the plugin that knows who is calling, an
  ``async (headers) -> Caller`` (raises its 401 for bad credentials); the batch routes record the
  caller of a create with it. Without it, every caller is one anonymous scope.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

#: ``services.shared`` key of the ``async (headers) -> Caller`` the access-control plugin registers.
CALLER_OF = "caller_of"
#: ``ctx.priority`` of a batch line (routing's admission order): below every tenant's (theirs end at -1000).
LINE_PRIORITY = -1001


@dataclass(frozen=True, slots=True)
class Caller:
    """Who made a request: its tenant, and the id of the key it used (None when auth is off)."""

    tenant: str
    key_id: str | None = None


@dataclass(frozen=True, slots=True)
class BatchLine:
    """Set by the batch runner on each line's context: whose batch it is, and which."""

    caller: Caller
    batch_id: str
    custom_id: str


class BatchesConfig(BaseModel):
    """Files (``/v1/files``), batches (``/v1/batches``) and the runner of batch lines."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(True, description="serve /v1/files and /v1/batches and run batches")
    files_dir: Path = Field(
        Path("data/files"),
        description="directory holding uploaded and produced files; shared by every replica (a volume)",
    )
    max_file_bytes: int = Field(
        100 * 1024 * 1024, ge=1024, description="largest file accepted by POST /v1/files; a larger one is a 413"
    )
    max_tenant_bytes: int = Field(
        10 * 1024**3,
        ge=1024,
        le=2**50,
        description="most bytes one tenant's files may hold in the file store (uploads, and the output and "
        "error files its batches write, which are counted but never refused); an upload past it, or a batch "
        "created once it is reached, is a 400 stored_bytes_exceeded",
    )
    max_tenant_files: int = Field(
        10_000,
        ge=1,
        le=10_000_000,
        description="most files one tenant may have stored (counted as max_tenant_bytes is); an upload past "
        "it, or a batch created once it is reached, is a 400 stored_files_exceeded",
    )
    max_lines: int = Field(50_000, ge=1, description="most lines in one batch's input file")
    max_active_batches: int = Field(
        100,
        ge=1,
        le=100_000,
        description="batches one tenant may have that are not final yet (each holds its input's lines in "
        "Redis while it runs); creating another is a 429",
    )
    max_tenant_batch_bytes: int = Field(
        1024**3,
        ge=1024,
        le=2**50,
        description="most bytes of input one tenant's unfinished batches may hold in Redis together (each "
        "batch copies its input file's lines there while it runs, counted at the file's size, however many "
        "batches share one file); creating one past it is a 429 batch_bytes_limit_reached",
    )
    redis_prefix: str = Field(
        "gw:batch", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$", description="Redis key prefix"
    )
    redis_timeout_ms: float = Field(2000, gt=0, le=30_000, description="bound on each Redis call")
    completion_window_s: float = Field(
        86400, gt=0, description="how long a batch ('completion_window': '24h') may run before it expires"
    )
    lease_s: float = Field(
        30,
        gt=0,
        le=3600,
        description="a replica's hold on a line it runs, or on a batch it validates or finalizes; renewed while it"
        " runs, taken over after",
    )
    poll_interval_s: float = Field(1.0, gt=0, le=60, description="how often a replica looks for batch work")
    max_in_flight: int = Field(16, ge=1, le=10_000, description="batch lines one replica runs at once")
    worker_max_in_flight: int = Field(
        4, ge=1, le=10_000, description="a line is sent only to a model with a worker holding fewer requests"
    )
    busy_lines_per_worker: int = Field(
        1,
        ge=0,
        le=10_000,
        description="while interactive requests run on a model's workers (or ran within interactive_quiet_s), "
        "at most this many of this replica's lines per available worker (0: none)",
    )
    interactive_quiet_s: float = Field(
        2.0,
        ge=0,
        le=3600,
        description="how long a model's workers must carry no interactive request before "
        "the batch grows back to worker_max_in_flight (0: never shrink)",
    )
    admission_share: float = Field(
        0.5,
        gt=0,
        le=1,
        description="a line is sent only while the model's admitted requests are below this share of "
        "routing's max_in_flight, and none waits",
    )
    engine_priority: int | None = Field(
        None,
        ge=-1_000_000,
        le=1_000_000,
        description="vLLM 'priority' sent with each line (larger = later); only for workers started with "
        "--scheduling-policy priority (others refuse the field)",
    )
    output_ttl_s: int = Field(30 * 86400, ge=60, description="how long batch output and error files are kept")
