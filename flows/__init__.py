"""Prefect flows (`pipeline`, `ab`, `hpo`) and what they share: their MLflow runs, preflight, trigger policy, retries,
UI artifacts and deployments; the pipeline's stage glue in `flows/stages/`. The work lives in tasks/."""
