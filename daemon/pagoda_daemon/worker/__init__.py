"""The worker side of a step: input preparation, the forward pass, and sampling."""
