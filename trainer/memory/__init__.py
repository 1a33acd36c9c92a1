"""GPU memory around rollouts: moving the training state out of the way while a colocated engine decodes."""
