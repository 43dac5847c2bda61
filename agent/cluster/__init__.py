"""Multi-node: etcd membership and leader election, the peer checkpoint tier, node-loss healing.

Torch-free like the rest of the agent. With no etcd endpoints configured the node is a cluster of
one and its own leader.
"""
