"""Checks of what voxserve produces: topology equivalence probes (and, with real weights, quality metrics)."""
