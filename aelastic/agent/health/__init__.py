"""The node's health: hangs found and named, failures explained, the job's root cause.

This room owns what the agent learns of its workers beyond their exits: their progress pages
(:mod:`.progress`), the bound that calls a worker hung (:mod:`.hang_rule`), a look at them
from outside (:mod:`.activity`), what was seen of them (:mod:`.seen`), their stacks
(:mod:`.stacks`), the watch that puts these together (:mod:`.stall`), a failure's details and
the report in torch's shape (:mod:`.errors`), the job's health as the rendezvous keeps it,
read and reported (:mod:`.heal`: budget and quarantine), and the health-check server
(:mod:`.check`).
"""
