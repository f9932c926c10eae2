"""V4 KV pools: compressed entries per token slot, windows and compressor states per request."""
