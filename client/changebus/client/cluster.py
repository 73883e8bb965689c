"""changebus.client.cluster: relays and bootstrap servers from a cluster's routing table.

The client's reading of a relay cluster's ZooKeeper routing table
(``docs/cluster.md``), public for the other slices (the bootstrap server
takes its relays from it) and for programs of their own. Importing it
imports kazoo; ``changebus.client`` itself does not.

* :class:`ClusterRoute` -- one partition's relays (leader first, or
  followers first) and bootstrap servers, kept current by watches;
* :func:`relays_serving` -- the relays serving a partition in a routing
  snapshot, in the order to try them;
* :func:`read_route` -- one look at the table (planners).

Details: :mod:`changebus.client._cluster`.
"""

from ._cluster import (
    ClusterRoute as ClusterRoute,
    read_route as read_route,
    relays_serving as relays_serving,
)

__all__ = ["ClusterRoute", "read_route", "relays_serving"]
