"""GPU plumbing shared by the sidecar and the client: CUDA IPC of result buffers.

torch and the CUDA driver are imported or loaded only when a GPU path is used.
"""
