"""Disaggregated weight sync: trainer ranks broadcast buckets to engine ranks on other nodes.

    # trainer rank s of S (rank 0 first: the others and the receivers need its endpoint)
    sender = CrossNodeSender(endpoint, rank=s, num_senders=S, num_receivers=R, group_host=MY_IP,
                             options=CrossNodeOptions(timeout_s=120))
    stats = sender.send(model.state_dict().items(), version=step)        # every RL step

    # engine rank r of R
    receiver = CrossNodeReceiver(endpoint, rank=r)
    receiver.receive(load)                                               # every RL step

The bytes move over the backend's collective library (gloo on CPU, NCCL, HCCL) through
hwsync's Communicator, in groups of their own (one per sender rank, formed with all the
receivers), independent of the trainer's and the engines' own worlds (carrier.py: the hub and
the other sender ranks' carriers, over hub.py, link.py, group.py and plan.py). Metadata moves on a
ZeroMQ control plane as msgpack, never pickle. See docs/disaggregated.md.
"""

from __future__ import annotations

from hwsync.disaggregated.forwarder import LocalForwarder, StagedForwarder
from hwsync.disaggregated.plan import CollectivePlan, assign_owners, make_plan, pack_layout
from hwsync.disaggregated.receiver import CrossNodeReceiver
from hwsync.disaggregated.sender import CrossNodeSender
from hwsync.protocol import BucketSpec

__all__ = ["BucketSpec", "CollectivePlan", "CrossNodeReceiver", "CrossNodeSender",
           "LocalForwarder", "StagedForwarder", "assign_owners", "make_plan", "pack_layout"]
