"""Running: the one loop (``runner``) over tasks (``task``: one output file, wherever it runs), in
this process or ``--jobs`` processes (``processes``) or as Dask tasks (``cluster``, reporting through
``events``); notebooks run per shard on Dask (``batch``)."""
