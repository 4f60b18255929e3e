"""tritune."""
