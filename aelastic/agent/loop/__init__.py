"""The agent's loop and its pure policy: one run of a node, attempt after attempt.

This room owns how a run goes: :class:`~.agent.ElasticAgent` composes the run's objects
(the workers of the current attempt, :mod:`.attempt`; the run's files and fork server,
:mod:`.run`; the round and its members, :mod:`.membership`; a peer's loss, :mod:`.recover`)
and asks the pure policy (:mod:`.policy`) what each outcome of an attempt
(:mod:`.supervise`) calls for. The rendezvous round into ranks (:mod:`.round`,
:mod:`.ranks`), how a run ends (:mod:`.ending`: the one place), the blocking entry point and
its signals (:mod:`.blocking`, :mod:`.signals`), the services beside a run
(:mod:`.services`) and small asyncio helpers (:mod:`.aio`) live here too. It uses the worker
processes (:mod:`aelastic.agent.processes`), the node's health (:mod:`aelastic.agent.health`)
and what the agent says (:mod:`aelastic.agent.output`); none of those imports it.
"""
