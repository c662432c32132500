"""mirroring: the broker's rules as sans-IO state machines.

Nothing here imports trio, opens a socket, reads the clock or sleeps: time comes in as an
argument and effects go out as return values, so every rule can be tested in isolation and
replayed from a seed.
"""
