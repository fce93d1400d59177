"""KV transfer between prefill and decode nodes, behind one transport interface.

base.py       KvTransport (push, abort_reservation), PushFailed, message limits
codec.py      tensors <-> raw bytes, one layer's K/V -> KvChunk messages
sender.py     the prefill side: engine layer callbacks -> header, chunks, done
receiver.py   the decode side: validate and write chunks, admit on done
grpc_transport.py   default: gRPC client-streaming of raw bytes
inproc.py     fake in-process transport for unit tests
"""
