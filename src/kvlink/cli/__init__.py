"""Command line: kvlink demo | serve | proxy | bench | plan."""
