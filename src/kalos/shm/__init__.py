"""Shared memory between a sidecar and its clients: the lowest layer, below both the transports
and the stores, and importing neither.

- :mod:`kalos.shm.memory`: memfd segments and their mappings (both sides);
- :mod:`kalos.shm.channel`: the control segment's and a channel's byte layout (re-exported by
  :mod:`kalos.protocol.layout` beside the uds and grpc frames);
- :mod:`kalos.shm.token_heap`: the token heap's layout, and a client's read-only mapping of it;
- :mod:`kalos.shm.session_index`: the session index's byte layout, and a client's reader.

The sidecar's writers (the heap's allocator, the index's writer) are stores:
:mod:`kalos.stores.token_heap`, :mod:`kalos.stores.session_index`.
"""
