"""Local process infrastructure: start a process, wait until healthy, stop it by PID, free ports.

Position in the layers (ARCHITECTURE.md): beside the bottom. `procs` imports nothing
from kvlink, so every layer that starts or addresses local processes can use it —
`serve` (a free side-channel port), `bench` (deployments), `cli` and the tests —
while imports keep pointing down. It is not part of `transfer`: it never touches NIXL.
"""
