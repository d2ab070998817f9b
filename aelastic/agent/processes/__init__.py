"""The workers as processes: started with torch's environment, awaited, stopped, guarded.

This room owns the processes an attempt runs: one worker (:mod:`.process`: start, await
through a pidfd, stop with SIGTERM, grace, SIGKILL), the set of an attempt
(:mod:`.group`), their environment (:mod:`.env`) and CPU binding (:mod:`.numa`), callables
run as workers (:mod:`.callables`, the runner script ``_call.py``, the fork server
:mod:`.forks`), hot spares (:mod:`.standby`, ``_standby.py``), what outlives the agent
(:mod:`.orphans` and the guardian ``_guard.py``; a worker that outlives SIGKILL,
:mod:`.unkillable`), the agent's beat that its workers watch (:mod:`.beat`), torch's file
timer (:mod:`.timer`) and the socket a worker talks to its agent on (:mod:`.inplace`). It
knows nothing of rounds or policy.
"""
