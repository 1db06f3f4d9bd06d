"""Request lifecycle: scheduler side and worker side of the connector, stats."""
