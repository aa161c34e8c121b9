"""The importance matrix of a finished set, computed a step (the embedding, a layer, the head) at a
time: the calibration text's state handed from step to step, each step's matrix products' inputs
summed as llama-imatrix sums them (``sums``), its tensors read from the set's files (``tensors``)."""
