"""specserve.control."""
