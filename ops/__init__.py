"""Pure tensor math: no I/O, no networking. Everything here is deterministic given its inputs."""
