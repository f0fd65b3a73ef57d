"""Checks of what legato produces: topology equivalence probes (and, with real weights, quality metrics)."""
