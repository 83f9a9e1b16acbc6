"""Promotion: the decision, the registry and its aliases, the serving check, the merged model."""
