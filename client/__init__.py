"""PGVI ClientApp."""
