"""Real multi-host test set-up: network namespaces as hosts, etcd and agent APIs on mutual TLS."""
