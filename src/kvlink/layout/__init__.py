"""Pure description of one worker's KV memory: specs, regions, page geometry."""
