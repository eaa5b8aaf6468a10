"""A store node (``pagekv serve``): :class:`.server.StoreNode`, its blocks (:mod:`.block_store`,
:mod:`.segment` with ``--shm``), its ZeroMQ loop's helpers (:mod:`.handlers`, :mod:`.outbox`,
:mod:`.guard`, :mod:`.monitor`, :mod:`.auth`), its bulk lane (:mod:`.lane`) and metrics."""
