"""Everything that leaves a sampler: Prometheus pull (``prometheus``), remote write
(``remote_write``) and Prometheus ``file_sd`` targets (``file_sd``)."""
