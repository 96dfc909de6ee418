"""The step probe: framework-neutral core (:mod:`.core`) and thin adapters (:mod:`.hf`,
:mod:`.lightning`); its ledger (:mod:`.ledger`) and outbox (:mod:`.outbox`)."""

from collector.probe.core import StepProbe
from collector.probe.ledger import ledger
from collector.probe.outbox import Outbox

__all__ = ["Outbox", "StepProbe", "ledger"]
