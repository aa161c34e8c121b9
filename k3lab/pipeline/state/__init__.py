"""The output folder's one owner: the only code that names, opens, writes or deletes anything in
``OUT/`` and ``OUT/.k3lab/``, split by idea.

- ``names``: what is in the folder (the layout on disk, README "On-disk state");
- ``codec``: a state file: ``k3lab-state/1 KIND SHA256`` then JSON, written atomically, read proven;
- ``lock``: the folder's ``flock``, held by the one run writing it;
- ``plans``: the plan and file 1's KVs, saved as one unit and loaded only when proven;
- ``record``: the typed record of a finished file and the manifest format (one parser, one writer);
- ``proof``: whether a file on disk is the one its record describes;
- ``records``: the records in ``.k3lab/``, the resume test, the merged ``MANIFEST.json``;
- ``folder``: ``OutputFolder``, the handle the others hang on (``folder.lock``, ``.plans``, ``.records``).
"""

from __future__ import annotations

from k3lab.pipeline.state.folder import OutputFolder

__all__ = ["OutputFolder"]
