"""The launch layer: the `pdserve` command line and everything that starts processes.

It sits above the nodes (`prefill_node`, `decode_node`) and the router, and is the only
package that imports them together: the CLI and its subcommands (`cli.py`, `commands/`),
a node process's main (`node_main.py`), `pdserve up`'s local cluster (`local_cluster.py`),
the local etcd launcher (`etcd_server.py`), the image's HEALTHCHECK (`healthcheck.py`) and
the default model's one-time preparation (`default_model.py`, `default_mtp.py`, `assets/`).
"""
