"""Weight sync from the trainer to rollout servers: bucketed tensor bytes over ZMQ."""

from raytool.weightsync.zmq_sync import WeightReceiver, WeightSender

__all__ = ["WeightReceiver", "WeightSender"]
