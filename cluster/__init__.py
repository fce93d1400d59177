"""pdserve cluster processes (router, prefill and decode nodes) and the `pdserve` CLI."""
