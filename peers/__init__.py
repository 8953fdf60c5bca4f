"""The network layer: DHT membership and matchmaking, the gRPC data plane.

hivemind is reached through `hivemind_adapter.py` only.
"""
