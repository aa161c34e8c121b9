"""Running: a run started (``start``: the plan, the folder held), the one loop (``runner``) over tasks
(``task``: one output file, wherever it runs), in this process or ``--jobs`` processes
(``processes``, with ``worker``: what a process running tasks needs) or as Dask tasks (``cluster``,
reporting through ``events``, paced by ``stages``); notebooks run per output file on Dask (``batch``)."""
