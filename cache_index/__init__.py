"""specserve.cache_index."""
