"""Weight sync from the trainer to rollout servers: checksummed buckets over ZMQ, relayed down a
chain of receivers; on one node, handles to the sender's buffers (CUDA IPC, shared memory) instead.

Files: `protocol.py` the wire format, `sender.py` the trainer side, `receiver.py` the server side,
`same_node.py` the same-node paths (CUDA IPC, shared memory) and when to take them, `collective.py`
the collective path (a process group's broadcast: gloo, NCCL, HCCL) beside ZMQ.
"""

from raytool.weightsync.protocol import AttestationError, ChecksumError, ServerSyncFailure, WeightSyncError, WeightSyncTimeout, chain_culprits
from raytool.weightsync.receiver import WeightReceiver
from raytool.weightsync.sender import WeightSender

__all__ = ["AttestationError", "ChecksumError", "ServerSyncFailure", "WeightReceiver", "WeightSender", "WeightSyncError", "WeightSyncTimeout", "chain_culprits"]
