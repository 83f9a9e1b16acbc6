"""Live serving: the router, its engines and adapters, and the online A/B test on its request log."""
