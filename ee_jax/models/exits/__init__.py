"""The exit machinery: exit configuration, exit heads and their checks, the cost of an
exit, thresholds with a guarantee, learned back-fill maps, and exit heads on disk."""
