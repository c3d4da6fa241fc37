"""The command line's own modules (``python -m jaxsync info|selftest``) and the
set-up helper ``_toolkit`` (run as a script by ``scripts/setup.sh``)."""
