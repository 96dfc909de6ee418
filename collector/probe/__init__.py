"""The step probe: framework-neutral core (:mod:`.core`) and thin adapters (:mod:`.hf`)."""

from collector.probe.core import Outbox, StepProbe, ledger

__all__ = ["Outbox", "StepProbe", "ledger"]
