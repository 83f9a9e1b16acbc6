"""Launchers and the local service stack."""
