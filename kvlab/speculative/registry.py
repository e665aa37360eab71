"""The proposers' registry (`SpeculativeConfig.method` names one); each proposer file
registers its class here."""

from __future__ import annotations

from kvlab.registry import Registry
from kvlab.speculative.base import Proposer

PROPOSERS: Registry[type[Proposer]] = Registry("proposer", "speculative.method")
