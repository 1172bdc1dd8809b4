"""A flow-level simulator of overcast's collectives at scale, and the planner built on it.

Layers, each using only those below: `topology` (switches, links, routes, trees), `fairness`
(max-min fair rates), `flows` (flows started and ended over time), `collectives` (the flows
each collective's schedule makes, from overcast.schedules), `engine` (what the host's CPU or an
offloaded engine costs per datagram), `run` (one simulated row, as `overcast simulate` prints
it) and `plan` (a training step's communication, as `overcast plan` prints it).
"""
