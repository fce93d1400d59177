"""The router: OpenAI-compatible HTTP and the gRPC Generate API in front of prefill/decode
nodes. Tokenizes, picks a prefill and a decode node by a routing policy, drives the PD flow,
detokenizes and applies stop strings, and replays a request on a healthy pair when a node
dies mid-stream. Stateless: any number of routers can serve one cluster."""
