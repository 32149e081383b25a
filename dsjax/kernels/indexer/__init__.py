"""The lightning indexer's decode scores over a slot's compressed index keys."""
