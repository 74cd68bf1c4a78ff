"""The PGVI ServerApp."""
