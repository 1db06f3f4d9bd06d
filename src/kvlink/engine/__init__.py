"""Reference engine: models, paged cache, block pool, scheduler, runner."""
