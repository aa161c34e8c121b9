"""Writing and records: one output file converted and streamed to disk (``convert``, ``single``), the
record of what it holds (``record``: one typed manifest), the proof that a file on disk is the one
its record describes (``proof``), and the output folder's one owner (``folder``)."""
