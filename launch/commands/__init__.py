"""One module per `pdserve` subcommand; each provides HELP, `add_arguments(parser)` and
`run(args) -> int`. Keep top-level imports light: import torch, grpc etc. inside `run`."""
