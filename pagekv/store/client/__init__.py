"""Store clients: :class:`.client.AsyncStoreClient` and its blocking wrapper
:class:`.blocking.StoreClient`, the routing and failover rules (:mod:`.routing`,
:mod:`.operations`) and the transports that carry a node's calls."""
