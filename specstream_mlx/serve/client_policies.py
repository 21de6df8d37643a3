"""Each client's own ``--tree auto`` policy, kept by a server.

A server decodes for many clients with one model. Pass costs are a fact of the
machine and the model, shared by all (:meth:`SpeculativeModel.tuner`); acceptance
evidence and back-off belong to one client's prompts, so one client's fallback to
plain decoding never switches another. The map is bounded: the least recently
served client is forgotten first.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Optional

from ..runtime.autotune import AutoPolicy
from ..runtime.loaded_model import SpeculativeModel
from ..runtime.sampling import SamplingParams

MAX_CLIENTS = 64


class ClientPolicies:
    """Per (decoding kind, client): a policy over its kind's shared machine facts."""

    def __init__(self, model: SpeculativeModel, max_clients: int = MAX_CLIENTS):
        self.model, self.max_clients = model, max_clients
        self.policies: "OrderedDict[tuple, AutoPolicy]" = OrderedDict()

    def get(self, sampling: SamplingParams, client: Any, log: Optional[Callable[[str], None]] = None) -> AutoPolicy:
        """``client``'s policy for this decoding kind, created on first use."""
        key = ("greedy" if sampling.greedy else "sampled", client)
        policy = self.policies.get(key)
        if policy is None:
            policy = self.policies[key] = self.model.tuner(sampling, log).for_client()
            while len(self.policies) > self.max_clients:
                self.policies.popitem(last=False)  # the least recently served client
        self.policies.move_to_end(key)
        return policy

    def __len__(self) -> int:
        return len(self.policies)

    def __contains__(self, key: tuple) -> bool:
        return key in self.policies
