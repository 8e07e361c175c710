"""Training features not yet shown to win and be stable; the recipe switches them on, and they are off by default."""
