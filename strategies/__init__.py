"""The PGVI server algorithm as a Flower Strategy, its schedules and its records."""
