"""changebus.bootstrap: the bootstrap server.

A client of the relay (the *producer*) appends every window to a persistent
**log store**; the *applier* folds the log into a **snapshot store** (the
latest row per key, with the SCN that last changed it). Consumers that fell
off the relays, or start from nothing, read a snapshot then catch up from the
log, and return to the relay (Databus's startSCN/targetSCN protocol, see
docs/protocol.md section 8). Storage is SQLite (default) or Postgres, same
code (:class:`Store`). Run it with ``changebus bootstrap --config
bootstrap.toml`` or embedded with :class:`BootstrapServer`. Seeding the
snapshot from the source -- online, in short keyset chunks merged at
watermark SCNs, resumable after a crash -- goes through one :class:`Seeder`
per source kind (:func:`seeder_for`: :func:`seed_postgres`,
:func:`seed_mysql`), given a :class:`SeedRequest` and reporting in a
:class:`SeedProgress`.
"""

from ._config import (
    ApplierConfig as ApplierConfig,
    BootstrapConfig as BootstrapConfig,
    HttpConfig as HttpConfig,
    ProducerConfig as ProducerConfig,
    SeedConfig as SeedConfig,
    StoreConfig as StoreConfig,
)
from ._daemon import BootstrapServer as BootstrapServer, run as run
from ._seed import seed_postgres as seed_postgres
from ._seed_mysql import seed_mysql as seed_mysql
from ._seeders import Seeder as Seeder, seeder_for as seeder_for
from ._seedtypes import (
    SeedProgress as SeedProgress,
    SeedRequest as SeedRequest,
    SeedWriter as SeedWriter,
)
from ._store import (
    CatchupPage as CatchupPage,
    PartitionState as PartitionState,
    SnapshotPage as SnapshotPage,
    Store as Store,
)

__all__ = [
    "ApplierConfig",
    "BootstrapConfig",
    "BootstrapServer",
    "CatchupPage",
    "HttpConfig",
    "PartitionState",
    "ProducerConfig",
    "SeedConfig",
    "SeedProgress",
    "SeedRequest",
    "SeedWriter",
    "Seeder",
    "SnapshotPage",
    "Store",
    "StoreConfig",
    "run",
    "seed_mysql",
    "seed_postgres",
    "seeder_for",
]
