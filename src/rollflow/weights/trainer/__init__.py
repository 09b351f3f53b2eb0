"""The transport halves' side of weight transfer: what runs on the trainer ranks (imports torch).

``sessions`` keeps per-process state that outlives one transport call (process groups, stores, HTTP
endpoints, CUDA IPC buffers) and the weight iterator every transport shares; ``broadcast``, ``vllm_nccl``,
``checkpoint`` and ``cuda_ipc`` hold each strategy's sessions, reached from its transport spec
(``rollflow.weights.<strategy>``) at call time.
"""
