"""Transport-free PGVI core: exponential families, divergences, losses, models, local/server GVI.

Nothing in this package imports flwr.
"""
