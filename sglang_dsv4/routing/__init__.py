"""Cache-aware routing over attention-DP ranks: each request to the rank that holds its session's
checkpoints, unless its load outweighs the prefill saved (:mod:`.scoring`)."""
