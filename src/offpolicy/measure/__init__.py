"""Measuring the mismatch: ``offpolicy diagnose`` (``diagnose``, its config ``diagnose_config``), its checks of
itself (``self_check``) and of the trainer's weight syncs (``sync_check``), the per-token viewer (``viewer``) and the
provenance block a run or a report carries (``provenance``; docs/development.md, "Layout")."""
