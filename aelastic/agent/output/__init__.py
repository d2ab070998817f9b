"""What the agent says: its events published, its own output, the workers' logs.

This room owns the agent's words: the publisher of its typed events and metrics
(:mod:`.publish`; the events themselves are public, :mod:`aelastic.agent.events`), its own
stdout and stderr written off the event loop (:mod:`.writer`), and the workers' log
directories, redirects and tee (:mod:`.logs`).
"""
