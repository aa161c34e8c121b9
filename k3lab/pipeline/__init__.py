"""The generic pipeline, knowing no model: the data's way through it, one folder per stage.

- ``model``, ``streams``, ``progress``: what every stage shares (the model interface, the stream
  engine that transforms run on, what a task reports);
- ``planning``: which source tensors go to which output file (types, shapes, bytes, memory);
- ``sources``: the checkpoint's bytes, local or from the Hub at one pinned commit;
- ``writing``: one output file streamed to disk, its record, and the output folder's one owner;
- ``running``: the one loop, in this process, in ``--jobs`` processes or as Dask tasks;
- ``publishing``: a set to a Hub repo from wherever its files are made;
- ``checking``: a set verified against its manifest, its plan and its source.
"""
