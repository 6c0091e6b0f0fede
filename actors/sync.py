"""Kept for scripts that import the actor-bound weight sync from here; it lives in
weightsync/actor_wire.py (the package imports it from there). No logic here."""

from __future__ import annotations

from miles.weightsync.actor_wire import ActorSyncLink as ActorSyncLink
from miles.weightsync.actor_wire import ShardedWeightSync as ShardedWeightSync
from miles.weightsync.actor_wire import WeightSync as WeightSync
