"""Deployment files: the HAProxy template and the local cluster launcher (docs/operations.md)."""
