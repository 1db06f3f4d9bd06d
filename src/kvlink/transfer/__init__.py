"""Effects: NIXL agent, side-channel handshake, wire structs."""
