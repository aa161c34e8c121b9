"""Publishing: a set to a Hub repo, each file uploaded from the machine that made it, committed in
batches by the client with the repo's manifest (``publish``)."""
