"""Talking to workers, choosing nothing: the pooled HTTP client with its bounded waits (``client``) and the
table of workers with their health, load and ejections (``workers``). Routing (which worker) is a
plugin's decision.

May import wire, ops, infra and engine.
"""
