"""AgentPerf-style benchmark: how many concurrent agents a server sustains under TTFT and output-speed SLOs.

Simulated agents replay multi-turn trajectories (``traces``, ``synthetic``) against any OpenAI-compatible
server (``server``), trial by trial (``replay``); each trial is judged per agent (``slo``); a search raises
concurrency until the SLO fails (``search``), for one or several configurations interleaved
(``benchmark``); ``report`` writes the JSON, table and plot; ``command`` is ``dsv4 agentperf``.
"""
