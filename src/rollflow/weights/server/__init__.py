"""The engine server's side of weight transfer: the receivers (``receiver.create_receiver``, which imports torch)
and the receive state machine the HTTP handlers call (``state.WeightReceiveState``, torch-free).
"""
