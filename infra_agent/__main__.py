"""``python -m infra_agent``: the console script (:mod:`infra_agent.entry`)."""

from infra_agent.entry import main

main()
