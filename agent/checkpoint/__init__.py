"""Tiered checkpoint storage (torch-free): manifests, atomic commits, memory/disk/object tiers,
background replication between tiers, and the catalog that picks what to restore."""
