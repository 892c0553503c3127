"""The gRPC master (replica registry, node leases, hotness, task mailboxes). Not built yet."""
