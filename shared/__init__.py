"""specserve.shared."""
