"""completion layer."""
