"""Ray actors: RunHost (drives Runs), ToolExecutor (stateless), the store actor, Supervisor."""

from actors.run_host import RunHost, dedicated_host, hosted_host
from actors.store_actor import RemoteCommitStore, StoreActor, open_system_store, store_actor
from actors.supervisor import Supervisor, supervisor
from actors.tool_executor import ExecutorPools, ToolExecutor
from actors.waves import RayToolRunner, WaveDispatcher
from actors.wire import RemoteError, RunMeta, SystemSpec, run_meta, unwrap

__all__ = [
    "ExecutorPools",
    "RayToolRunner",
    "RemoteCommitStore",
    "RemoteError",
    "RunHost",
    "RunMeta",
    "StoreActor",
    "Supervisor",
    "SystemSpec",
    "ToolExecutor",
    "WaveDispatcher",
    "dedicated_host",
    "hosted_host",
    "open_system_store",
    "run_meta",
    "store_actor",
    "supervisor",
    "unwrap",
]
