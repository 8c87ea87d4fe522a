"""specserve.worker."""
