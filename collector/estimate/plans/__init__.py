"""``stepmem estimate --plan``: when a step does not fit, the changes that make it fit, each
traced (:mod:`~collector.estimate.plans.search`) from the knobs of
:mod:`~collector.estimate.plans.knobs`, costed (:mod:`~collector.estimate.plans.cost`), and
printed as the command that checks it (:mod:`~collector.estimate.plans.command`,
:mod:`~collector.estimate.plans.render`)."""
