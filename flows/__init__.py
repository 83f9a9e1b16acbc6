"""Prefect flows only; the work lives in tasks/."""
