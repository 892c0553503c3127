"""The gdskv master: a gRPC registry of nodes (with leases) and of every replica.

- :mod:`gdskv.master.registry`: the state (nodes, objects, replicas, hotness, mailboxes);
- :mod:`gdskv.master.service`: the gRPC service in front of it (proto in ``proto/``,
  generated code in :mod:`gdskv.master._proto`, rebuilt by ``scripts/gen_protos.py``);
- :mod:`gdskv.master.server`: :class:`MasterServer` and the ``gdskv-master`` command;
- :mod:`gdskv.master.client`: :class:`MasterClient`, the typed batch client used by nodes
  and by :func:`gdskv.connect`.

The master never imports the store, the tiers or the I/O engines: data never goes through
it. This package's ``__init__`` imports nothing, so that importing one submodule stays light.
"""
