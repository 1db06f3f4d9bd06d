"""OpenAI-compatible servers and the P/D proxy."""
