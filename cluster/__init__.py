"""The substrate the nodes and the router share: etcd discovery, KV transfer, proto
conversion, a node's engine thread and gRPC server. It imports only `engine`."""
