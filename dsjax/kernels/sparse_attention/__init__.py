"""V4 sparse decode attention: 64 query heads over one shared K=V head, the sliding-window keys plus
the compressed entries a slot's indexer picked (or all of them), with per-head sinks."""
